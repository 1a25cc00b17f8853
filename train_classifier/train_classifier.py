"""Trains the spike classifier from profiled batches and writes classifier.pkl, .npz and .json.

Reads every ``*.csv.gz`` written by ``generate_training_data.py``, keeps the
measured candidate batches (``status == "ok"``, the first batch itself left
out), computes features with :func:`dynabatch.memory.features.compute_features`
(the planner's own function) and labels a batch 1 when its peak activation
exceeds ``--spike-ratio`` (0.90) of its first batch's.

The model is a ``HistGradientBoostingClassifier`` with monotonic constraints
where the physics is certain: more rows, more tokens or longer rows in the
candidate never need less memory (+1); a larger first batch never has a smaller
peak, so it never makes a spike likelier (-1).

Two classifiers are trained: over dynabatch 0.1.6's 13 ratio features
(``classifier.pkl``, used when the planner knows nothing of the model) and over
those and ``memory_ratio_estimate``, from the model's shape
(``classifier-shape.pkl``, used when the user passes a ``ModelShape``). The
report shows both, so the second's gain on held-out families is measured.

Before the final fit, every model and then every family is held out in turn
(fitted on the others, evaluated on it). At ``--threshold`` the tables give, per
measured candidate, the spike recall, the false-safe rate (predicted safe,
measured ratio > spike ratio) and the over-budget rate (predicted safe, measured
ratio > 1.0); and per profiled position, what the planner's rule would pick
among the measured candidates: unsafe picks (measured ratio > 1.0: the first
batch's peak exceeded), spike picks (> spike ratio), and growth, the pick's
size over the oracle's (the largest measured candidate with ratio <= spike
ratio); positions where even the smallest candidate is a spike leave no
choice and are counted apart. The tables and the probability calibration are written to
``--report`` (REPORT.md beside this script).

Beside each pickle goes its compiled form (``classifier.npz``: the same trees
as plain arrays, tied to the pickle's sha256), what dynabatch loads at run time
without unpickling or importing scikit-learn. It is read back and checked
against the estimator's own predictions before the script moves on.
``--compile-only`` writes it for pickles already in ``--out`` (trained by an
earlier version of this script) without retraining.

Example:
    python train_classifier/train_classifier.py                # bundled data -> dynabatch/models/
    python train_classifier/train_classifier.py --data /tmp/profiles --out /tmp/clf
    python train_classifier/train_classifier.py --compile-only --out /tmp/clf   # .npz for existing pickles
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

import joblib
import numpy as np
import pandas as pd
import sklearn

from dynabatch.memory.classifier import write_compiled
from dynabatch.memory.classifier_fit import (
    MONOTONIC,
    PROFILE_COLUMNS,
    candidate_rows,
    feature_names,
    features_of,
    fit_spike_classifier,
    sha256_files,
)

logger = logging.getLogger("train_classifier")

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "data"
DEFAULT_OUT = HERE.parent / "dynabatch" / "models"


def data_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.csv.gz"))
    if not files:
        raise SystemExit(f"no *.csv.gz profile files in {folder}")
    return files


def load_rows(files: list[Path]) -> pd.DataFrame:
    """The measured candidate batches of all files, with their measured ratio."""
    frame = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    counts = frame["status"].value_counts().to_dict()
    logger.info("read %d rows from %d files; status counts %s", len(frame), len(files), counts)
    rows = candidate_rows(frame)
    dtypes = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    rows["setting"] = (rows["dtype"].map(dtypes).fillna(rows["dtype"]) + " "
                       + rows["attn_implementation"] + " b" + rows["num_beams"].astype(str) + " new"
                       + rows["max_new_tokens"].astype(str))
    return rows


VARIANTS = {False: "classifier", True: "classifier-shape"}
"""File stem of each classifier, by whether it takes the model's shape."""


def fit(rows: pd.DataFrame, args: argparse.Namespace, shape: bool):
    return fit_spike_classifier(rows, args.spike_ratio, shape=shape, max_iter=args.max_iter,
                                learning_rate=args.learning_rate, max_leaf_nodes=args.max_leaf_nodes)


def planner_picks(rows: pd.DataFrame, proba: np.ndarray, threshold: float, spike_ratio: float) -> pd.DataFrame:
    """What the planner's rule picks at each profiled position, next to the oracle.

    At each (run, position) the measured candidates are taken smallest first;
    the pick is the largest one with it and every smaller one predicted safe
    (or the smallest, the fallback). The oracle is the largest measured
    candidate whose measured ratio is <= ``spike_ratio`` (or the smallest).
    """
    scored = rows.assign(proba=proba).sort_values(["run", "position", "batch_size"])
    out = []
    for (_, _), group in scored.groupby(["run", "position"], sort=False):
        safe = (group["proba"] <= threshold).to_numpy()
        k = len(safe) if safe.all() else int(np.argmin(safe))
        pick = group.iloc[max(k - 1, 0)]
        fits = np.nonzero((group["ratio"] <= spike_ratio).to_numpy())[0]
        oracle = group.iloc[fits[-1]] if len(fits) else group.iloc[0]
        forced = group["ratio"].iloc[0] > spike_ratio  # even the smallest candidate is a spike
        out.append((pick["batch_size"], pick["ratio"], oracle["batch_size"], forced))
    return pd.DataFrame(out, columns=["pick_size", "pick_ratio", "oracle_size", "forced"])


def metrics(rows: pd.DataFrame, proba: np.ndarray, threshold: float, spike_ratio: float) -> dict:
    """Row metrics (each measured candidate) and pick metrics (what the planner would choose)."""
    ratio = rows["ratio"].to_numpy()
    spike = ratio > spike_ratio
    safe = proba <= threshold
    n_safe = int(safe.sum())
    every = planner_picks(rows, proba, threshold, spike_ratio)
    picks = every[~every["forced"]]
    growth = picks["pick_size"] / picks["oracle_size"]
    observed = [(lo, hi, spike[(proba >= lo) & (proba < hi)]) for lo, hi in
                ((0, threshold), (threshold, 0.25), (0.25, 0.75), (0.75, 1.0001))]
    return {
        "rows": len(ratio),
        "spikes": int(spike.sum()),
        "spike_recall": float((~safe & spike).sum() / max(spike.sum(), 1)),
        "predicted_safe": n_safe,
        "false_safe_rate": float((safe & spike).sum() / max(n_safe, 1)),
        "over_budget_rate": float((safe & (ratio > 1.0)).sum() / max(n_safe, 1)),
        "max_ratio_predicted_safe": float(ratio[safe].max()) if n_safe else None,
        "positions": len(picks),
        "forced_positions": int(every["forced"].sum()),
        "unsafe_picks": int((picks["pick_ratio"] > 1.0).sum()),
        "spike_picks": int((picks["pick_ratio"] > spike_ratio).sum()),
        "growth_mean": float(growth.mean()),
        "growth_p10": float(growth.quantile(0.1)),
        "calibration": [{"proba": f"[{lo:g}, {min(hi, 1):g})", "rows": len(obs),
                         "spike_rate": float(obs.mean()) if len(obs) else None} for lo, hi, obs in observed],
    }


def held_out(rows: pd.DataFrame, by: str, args: argparse.Namespace, shape: bool) -> dict:
    """For each value of column ``by`` (model or family): fit on the other rows, score its rows."""
    results = {}
    pooled_rows, pooled_proba = [], []
    for group in sorted(rows[by].unique()):
        test = (rows[by] == group).to_numpy()
        train = rows[~test]
        if train.empty or train["ratio"].gt(args.spike_ratio).nunique() < 2:
            continue
        proba = fit(train, args, shape).predict_proba(features_of(rows[test], shape))[:, 1]
        results[group] = metrics(rows[test], proba, args.threshold, args.spike_ratio)
        pooled_rows.append(rows[test])
        pooled_proba.append(proba)
    if pooled_rows:
        results["ALL"] = metrics(pd.concat(pooled_rows), np.concatenate(pooled_proba), args.threshold,
                                 args.spike_ratio)
    return results


def table(title: str, results: dict) -> str:
    """A markdown table of held-out results."""
    lines = [f"#### {title}", "",
             ("| held out | rows | spikes | spike recall | predicted safe | false-safe | ratio>1 among safe | "
             "positions | unsafe picks | spike picks | growth mean | growth p10 | forced |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for group, m in results.items():
        lines.append(
            f"| {group} | {m['rows']} | {m['spikes']} | {m['spike_recall']:.3f} | {m['predicted_safe']} | "
            f"{m['false_safe_rate']:.3f} | {m['over_budget_rate']:.3f} | {m['positions']} | {m['unsafe_picks']} | "
            f"{m['spike_picks']} ({m['spike_picks'] / max(m['positions'], 1):.1%}) | {m['growth_mean']:.2f} | "
            f"{m['growth_p10']:.2f} | {m['forced_positions']} |")
    return "\n".join(lines) + "\n"


def comparison(results: dict[bool, dict]) -> str:
    """Before/after per held-out family: the 13 features alone, then with the model's shape."""
    lines = [("| held out family | positions | unsafe picks: 13 / +shape | spike picks: 13 / +shape | "
             "growth mean: 13 / +shape | growth p10: 13 / +shape |"), "|---|---:|---:|---:|---:|---:|"]
    before, after = results[False]["family"], results[True]["family"]
    for group in before:
        b, a = before[group], after[group]
        lines.append(f"| {group} | {b['positions']} | {b['unsafe_picks']} / {a['unsafe_picks']} | "
                     f"{b['spike_picks'] / max(b['positions'], 1):.1%} / {a['spike_picks'] / max(a['positions'], 1):.1%}"
                     f" | {b['growth_mean']:.2f} / {a['growth_mean']:.2f} | {b['growth_p10']:.2f} / "
                     f"{a['growth_p10']:.2f} |")
    return "\n".join(lines) + "\n"


def targets(results: dict) -> str:
    """Which held-out families meet the targets: 0 unsafe picks, <= 1% spike picks, growth mean >= 0.85."""
    met, missed = [], []
    for group, m in results["family"].items():
        if group == "ALL":
            continue
        reasons = []
        if m["unsafe_picks"]:
            reasons.append(f"{m['unsafe_picks']} unsafe picks")
        if m["spike_picks"] > 0.01 * m["positions"]:
            reasons.append(f"{m['spike_picks'] / m['positions']:.1%} spike picks")
        if m["growth_mean"] < 0.85:
            reasons.append(f"growth mean {m['growth_mean']:.2f}")
        (missed if reasons else met).append(f"{group} ({', '.join(reasons)})" if reasons else group)
    return (f"Targets (0 unsafe picks, <= 1% spike picks, growth mean >= 0.85) met by {len(met)} of "
            f"{len(met) + len(missed)} held-out families: {', '.join(met) or 'none'}. Missed: "
            f"{'; '.join(missed) or 'none'}.\n")


def write_report(path: Path, files: list[Path], rows: pd.DataFrame, results: dict[bool, dict],
                 args: argparse.Namespace) -> None:
    """REPORT.md: the data, the held-out tables of both classifiers and the calibration, regenerated by every run."""
    where = f"at threshold {args.threshold}, spike = measured ratio > {args.spike_ratio}"
    data = rows.groupby(["device", "family", "model"]).agg(
        rows=("ratio", "size"), spikes=("ratio", lambda r: int((r > args.spike_ratio).sum())),
        first_batch_sizes=("first_batch_size", lambda b: ",".join(map(str, sorted(b.unique())))),
        max_input_lengths=("max_input_length", lambda m: ",".join(map(str, sorted(m.unique())))),
        settings=("setting", lambda s: ", ".join(sorted(s.unique()))),
        sources=("text_source", lambda s: ", ".join(sorted(s.unique()))),
    ).reset_index()
    lines = [
        "# Spike classifier: held-out evaluation",
        "",
        ("Written by `python train_classifier/train_classifier.py` from the profiles in "
        f"`{args.data.name}/` ({', '.join(f.name for f in files)}); do not edit by hand."),
        "",
        "## Data (measured candidate batches)",
        "",
        "Settings: dtype, attention, beams (`bN`), new tokens (`newN`, 0: forward) and text sources.",
        "",
        "| device | family | model | rows | spikes | first batch sizes | max input lengths | settings | texts |",
        "|---|---|---|---:|---:|---|---|---|---|",
        *[f"| {r.device} | {r.family} | {r.model} | {r.rows} | {r.spikes} | {r.first_batch_sizes} | "
          f"{r.max_input_lengths} | {r.settings} | {r.sources} |" for r in data.itertuples()],
        "",
        "## Before / after: the model's shape (leave-one-family-out)",
        "",
        ("*13*: dynabatch 0.1.6's ratio features, what the planner uses when it is told nothing of the model. "
        "*+shape*: with `memory_ratio_estimate`, from `ModelShape.from_model(model, max_new_tokens=..., "
        "num_beams=...)` passed as `model_shape=` (see `dynabatch/memory/features.py`)."),
        "",
        comparison(results),
        "13 features: " + targets(results[False]),
        "+shape: " + targets(results[True]),
        "## Held out",
        "",
        ("Per candidate: *spike recall* (spikes predicted unsafe), *false-safe* (predicted safe, ratio > "
        f"{args.spike_ratio}), *ratio>1 among safe*. Per position, what the planner's rule picks among the "
        "measured candidates: *unsafe picks* (ratio > 1.0: the first batch's peak exceeded), *spike picks*, "
        "*growth* (pick size / largest measured candidate with ratio <= "
        f"{args.spike_ratio}). *Forced* positions, where even the smallest candidate (`batch_size` rows) "
        f"measured above {args.spike_ratio} (e.g. right after the first batch, with texts as long as its own), "
        "leave the planner no choice; they are counted apart and left out of the pick columns."),
        "",
    ]
    for shape, label in ((False, "13 features"), (True, "with the model's shape")):
        lines += [f"### {label}", ""]
        for by, by_group in results[shape].items():
            title = f"In sample (the final classifier on its training rows) {where}" if by.startswith("in-sample") \
                else f"Leave-one-{by}-out {where}"
            lines.append(table(title, by_group))
    for shape, label in ((False, "13 features"), (True, "with the model's shape")):
        lines += [f"## Calibration, {label} (leave-one-family-out, all families pooled)", "",
                  "| predicted spike probability | rows | measured spike rate |", "|---|---:|---:|"]
        for cell in results[shape]["family"]["ALL"]["calibration"]:
            rate = "-" if cell["spike_rate"] is None else f"{cell['spike_rate']:.3f}"
            lines.append(f"| {cell['proba']} | {cell['rows']} | {rate} |")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    logger.info("wrote %s", path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help=f"folder of *.csv.gz profiles (default: {DEFAULT_DATA})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"folder to write classifier.pkl, .npz and .json (default: {DEFAULT_OUT})")
    p.add_argument("--spike-ratio", type=float, default=0.9,
                   help="a batch is a spike when its peak exceeds this fraction of the first batch's (default: 0.9)")
    p.add_argument("--threshold", type=float, default=0.025,
                   help="spike probability at or below which a batch counts as predicted safe (default: 0.025)")
    p.add_argument("--max-iter", type=int, default=100, help="boosting iterations (default: 100)")
    p.add_argument("--learning-rate", type=float, default=0.1, help="boosting learning rate (default: 0.1)")
    p.add_argument("--max-leaf-nodes", type=int, default=15, help="leaves per tree (default: 15)")
    p.add_argument("--report", type=Path, default=HERE / "REPORT.md",
                   help=f"markdown report of the held-out evaluation (default: {HERE / 'REPORT.md'})")
    p.add_argument("--skip-held-out", action="store_true", help="fit the final model only, no evaluation or report")
    p.add_argument("--compile-only", action="store_true",
                   help="no training: write the compiled .npz beside the pickles already in --out (and record it "
                        "in their .json)")
    return p.parse_args(argv)


def evaluate(rows: pd.DataFrame, estimator, args: argparse.Namespace, shape: bool) -> dict:
    """Held-out tables (by model, by family) and the final classifier in sample."""
    where = f"at threshold {args.threshold} (spike = measured ratio > {args.spike_ratio})"
    label = "+shape" if shape else "13 features"
    results = {}
    for by in ("model", "family"):
        results[by] = held_out(rows, by, args, shape)
        print(table(f"{label}: leave-one-{by}-out {where}", results[by]))
    # The final classifier on its own training positions: what the bundled planner does on models it knows.
    proba = estimator.predict_proba(features_of(rows, shape))[:, 1]
    results["in-sample model"] = {
        **{m: metrics(rows[rows["model"] == m], proba[(rows["model"] == m).to_numpy()], args.threshold,
                      args.spike_ratio) for m in sorted(rows["model"].unique())},
        "ALL": metrics(rows, proba, args.threshold, args.spike_ratio),
    }
    print(table(f"{label}: in sample {where}", results["in-sample model"]))
    return results


def write_classifier(out: Path, stem: str, estimator, shape: bool, files: list[Path], rows: pd.DataFrame,
                     profiles: Path, results: dict, args: argparse.Namespace) -> None:
    """``<stem>.pkl``, its compiled trees ``<stem>.npz`` (checked) and its metadata ``<stem>.json`` (versions,
    hashes, features, held-out figures)."""
    pkl = out / f"{stem}.pkl"
    joblib.dump(estimator, pkl)
    compiled_sha256 = write_compiled(estimator, pkl)
    names = feature_names(shape)
    meta = {
        "sklearn_version": sklearn.__version__,
        "shape": shape,
        "feature_names": list(names),
        "monotonic_cst": {name: MONOTONIC[name] for name in names},
        "spike_ratio": args.spike_ratio,
        "threshold": args.threshold,
        "params": {"max_iter": args.max_iter, "learning_rate": args.learning_rate,
                   "max_leaf_nodes": args.max_leaf_nodes},
        "classifier_sha256": hashlib.sha256(pkl.read_bytes()).hexdigest(),
        "compiled_sha256": compiled_sha256,
        "profiles_sha256": hashlib.sha256(profiles.read_bytes()).hexdigest(),
        "training_data": {
            "files": [f.name for f in files],
            "sha256": sha256_files(files),
            "rows": len(rows),
            "spikes": int(rows["ratio"].gt(args.spike_ratio).sum()),
            "models": sorted(rows["model"].unique().tolist()),
            "families": sorted(rows["family"].unique().tolist()),
            "devices": sorted(rows["device"].unique().tolist()),
        },
        "trained_on": ", ".join(f"{d}:{m}" for d, m in sorted(set(zip(rows["device"], rows["model"])))),
        "held_out_metrics": results,
    }
    (out / f"{stem}.json").write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    logger.info("wrote %s, %s and %s", pkl, pkl.with_suffix(".npz"), out / f"{stem}.json")


def compile_only(out: Path) -> None:
    """Writes ``<stem>.npz`` beside each ``<stem>.pkl`` already in ``out`` and records it in ``<stem>.json``.

    The pickle is unpickled only if it is the file its .json describes (sha256) and was written by this
    scikit-learn version.
    """
    for stem in VARIANTS.values():
        pkl, meta_path = out / f"{stem}.pkl", out / f"{stem}.json"
        if not pkl.is_file() or not meta_path.is_file():
            raise SystemExit(f"--compile-only needs {pkl.name} and {meta_path.name} in {out}")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if hashlib.sha256(pkl.read_bytes()).hexdigest() != meta.get("classifier_sha256"):
            raise SystemExit(f"{pkl} does not match the classifier_sha256 in {meta_path.name}; not unpickling it")
        if meta.get("sklearn_version") != sklearn.__version__:
            raise SystemExit(f"{pkl} was written by scikit-learn {meta.get('sklearn_version')}, this is "
                             f"{sklearn.__version__}: retrain it instead")
        compiled_sha256 = write_compiled(joblib.load(pkl), pkl)
        items = [(key, value) for key, value in meta.items() if key != "compiled_sha256"]
        at = [key for key, _ in items].index("classifier_sha256") + 1
        meta = dict([*items[:at], ("compiled_sha256", compiled_sha256), *items[at:]])
        meta_path.write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
        logger.info("wrote %s and recorded it in %s", pkl.with_suffix(".npz"), meta_path)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.compile_only:
        compile_only(args.out)
        return 0
    files = data_files(args.data)
    rows = load_rows(files)
    if rows["ratio"].gt(args.spike_ratio).nunique() < 2:
        raise SystemExit("the profiles hold only one class; profile more settings")
    args.out.mkdir(parents=True, exist_ok=True)
    # A compact copy of the training rows ships with the package: if a pickle
    # cannot be used (another scikit-learn, a damaged file) dynabatch refits from it.
    profiles = args.out / "profiles.csv.gz"
    rows.loc[:, list(PROFILE_COLUMNS)].to_csv(profiles, index=False, compression={"method": "gzip", "mtime": 0})
    results = {}
    for shape, stem in VARIANTS.items():
        estimator = fit(rows, args, shape)
        results[shape] = {} if args.skip_held_out else evaluate(rows, estimator, args, shape)
        write_classifier(args.out, stem, estimator, shape, files, rows, profiles, results[shape], args)
    if not args.skip_held_out:
        write_report(args.report, files, rows, results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
