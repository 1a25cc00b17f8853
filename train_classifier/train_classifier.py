"""Trains the spike classifier from profiled batches and writes classifier.pkl + classifier.json.

Reads every ``*.csv.gz`` written by ``generate_training_data.py``, keeps the
measured candidate batches (``status == "ok"``, the first batch itself left
out), computes features with :func:`dynabatch.features.compute_features`
(the planner's own function) and labels a batch 1 when its peak activation
exceeds ``--spike-ratio`` (0.90) of its first batch's.

The model is a ``HistGradientBoostingClassifier`` with monotonic constraints
where the physics is certain: more rows, more tokens or longer rows in the
candidate never need less memory (+1); a larger first batch never has a smaller
peak, so it never makes a spike likelier (-1).

Before the final fit, every model is held out in turn (trained on the others,
evaluated on it): the printed table gives, at ``--threshold``, the spike
recall, the false-safe rate (predicted safe, measured ratio > spike ratio) and
the over-budget rate (predicted safe, measured ratio > 1.0).

Example:
    python train_classifier/train_classifier.py                # bundled data -> dynabatch/models/
    python train_classifier/train_classifier.py --data /tmp/profiles --out /tmp/clf
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
from sklearn.ensemble import HistGradientBoostingClassifier

from dynabatch.features import FEATURE_NAMES, compute_features

logger = logging.getLogger("train_classifier")

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "data"
DEFAULT_OUT = HERE.parent / "dynabatch" / "models"

MONOTONIC = {
    "max_input_length": 0,
    "token_size_x": -1,
    "token_size_y": 1,
    "token_size_diff": 1,
    "batch_size_x": -1,
    "batch_size_y": 1,
    "batch_size_diff": 1,
    "total_tokens_x": -1,
    "total_tokens_y": 1,
    "total_token_size_diff": 1,
    "paddings_x": -1,
    "paddings_y": 1,
    "total_paddings_diff": 1,
}


def data_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.csv.gz"))
    if not files:
        raise SystemExit(f"no *.csv.gz profile files in {folder}")
    return files


def sha256_files(files: list[Path]) -> str:
    """One digest over the files' names and bytes, in name order."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def load_rows(files: list[Path]) -> pd.DataFrame:
    """The measured candidate batches of all files, with their measured ratio."""
    frame = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    counts = frame["status"].value_counts().to_dict()
    logger.info("read %d rows from %d files; status counts %s", len(frame), len(files), counts)
    frame = frame[(frame["status"] == "ok") & (frame["position"] > 0)].copy()
    frame["ratio"] = frame["peak_bytes"] / frame["first_peak_bytes"]
    return frame.reset_index(drop=True)


def features_of(frame: pd.DataFrame) -> pd.DataFrame:
    values = compute_features(
        max_input_length=frame["max_input_length"].to_numpy(),
        token_size_x=frame["first_token_size"].to_numpy(),
        batch_size_x=frame["first_batch_size"].to_numpy(),
        total_tokens_x=frame["first_total_tokens"].to_numpy(),
        token_size_y=frame["token_size"].to_numpy(),
        batch_size_y=frame["batch_size"].to_numpy(),
        total_tokens_y=frame["total_tokens"].to_numpy(),
    )
    return pd.DataFrame(values, columns=list(FEATURE_NAMES))


def make_estimator(args: argparse.Namespace) -> HistGradientBoostingClassifier:
    return HistGradientBoostingClassifier(
        max_iter=args.max_iter,
        learning_rate=args.learning_rate,
        max_leaf_nodes=args.max_leaf_nodes,
        l2_regularization=1.0,
        monotonic_cst=[MONOTONIC[name] for name in FEATURE_NAMES],
        early_stopping=False,
        random_state=0,
    )


def metrics(ratio: np.ndarray, proba: np.ndarray, threshold: float, spike_ratio: float) -> dict:
    spike = ratio > spike_ratio
    safe = proba <= threshold
    n_safe = int(safe.sum())
    return {
        "rows": int(len(ratio)),
        "spikes": int(spike.sum()),
        "spike_recall": float((~safe & spike).sum() / max(spike.sum(), 1)),
        "predicted_safe": n_safe,
        "false_safe_rate": float((safe & spike).sum() / max(n_safe, 1)),
        "over_budget_rate": float((safe & (ratio > 1.0)).sum() / max(n_safe, 1)),
        "max_ratio_predicted_safe": float(ratio[safe].max()) if n_safe else None,
    }


def held_out(frame: pd.DataFrame, X: pd.DataFrame, y: np.ndarray, args: argparse.Namespace) -> dict:
    """Leave-one-model-out: for each model, fit on the others and score it."""
    results = {}
    pooled_ratio, pooled_proba = [], []
    for model in sorted(frame["model"].unique()):
        test = (frame["model"] == model).to_numpy()
        if (~test).sum() == 0 or len(np.unique(y[~test])) < 2:
            continue
        est = make_estimator(args).fit(X[~test], y[~test])
        proba = est.predict_proba(X[test])[:, 1]
        ratio = frame.loc[test, "ratio"].to_numpy()
        results[model] = metrics(ratio, proba, args.threshold, args.spike_ratio)
        pooled_ratio.append(ratio)
        pooled_proba.append(proba)
    if pooled_ratio:
        results["ALL"] = metrics(np.concatenate(pooled_ratio), np.concatenate(pooled_proba), args.threshold,
                                 args.spike_ratio)
    return results


def print_table(results: dict) -> None:
    head = f"{'held-out model':<16}{'rows':>6}{'spikes':>8}{'recall':>8}{'pred.safe':>10}{'false-safe':>11}" \
           f"{'ratio>1':>9}{'max ratio safe':>16}"
    print(head)
    print("-" * len(head))
    for model, m in results.items():
        mx = m["max_ratio_predicted_safe"]
        print(f"{model:<16}{m['rows']:>6}{m['spikes']:>8}{m['spike_recall']:>8.3f}{m['predicted_safe']:>10}"
              f"{m['false_safe_rate']:>11.4f}{m['over_budget_rate']:>9.4f}{('-' if mx is None else f'{mx:.3f}'):>16}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help=f"folder of *.csv.gz profiles (default: {DEFAULT_DATA})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"folder to write classifier.pkl and classifier.json (default: {DEFAULT_OUT})")
    p.add_argument("--spike-ratio", type=float, default=0.9,
                   help="a batch is a spike when its peak exceeds this fraction of the first batch's (default: 0.9)")
    p.add_argument("--threshold", type=float, default=0.025,
                   help="spike probability at or below which a batch counts as predicted safe (default: 0.025)")
    p.add_argument("--max-iter", type=int, default=100, help="boosting iterations (default: 100)")
    p.add_argument("--learning-rate", type=float, default=0.1, help="boosting learning rate (default: 0.1)")
    p.add_argument("--max-leaf-nodes", type=int, default=15, help="leaves per tree (default: 15)")
    p.add_argument("--skip-held-out", action="store_true", help="fit the final model only, no evaluation")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    files = data_files(args.data)
    frame = load_rows(files)
    X = features_of(frame)
    y = (frame["ratio"] > args.spike_ratio).to_numpy().astype(int)
    if len(np.unique(y)) < 2:
        raise SystemExit("the profiles hold only one class; profile more settings")
    results = {} if args.skip_held_out else held_out(frame, X, y, args)
    if results:
        print(f"leave-one-model-out at threshold {args.threshold} (spike = ratio > {args.spike_ratio}):")
        print_table(results)
    estimator = make_estimator(args).fit(X, y)
    args.out.mkdir(parents=True, exist_ok=True)
    pkl = args.out / "classifier.pkl"
    joblib.dump(estimator, pkl)
    meta = {
        "sklearn_version": sklearn.__version__,
        "feature_names": list(FEATURE_NAMES),
        "monotonic_cst": MONOTONIC,
        "spike_ratio": args.spike_ratio,
        "threshold": args.threshold,
        "params": {k: v for k, v in estimator.get_params().items() if k != "monotonic_cst"},
        "classifier_sha256": hashlib.sha256(pkl.read_bytes()).hexdigest(),
        "training_data": {
            "files": [f.name for f in files],
            "sha256": sha256_files(files),
            "rows": int(len(frame)),
            "spikes": int(y.sum()),
            "models": sorted(frame["model"].unique().tolist()),
            "families": sorted(frame["family"].unique().tolist()),
            "devices": sorted(frame["device"].unique().tolist()),
        },
        "trained_on": ", ".join(f"{d}:{m}" for d, m in sorted(set(zip(frame["device"], frame["model"])))),
        "held_out_metrics": results,
    }
    (args.out / "classifier.json").write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    logger.info("wrote %s and %s", pkl, args.out / "classifier.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
