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

from dynabatch._training import (
    MONOTONIC,
    PROFILE_COLUMNS,
    candidate_rows,
    features_of,
    fit_spike_classifier,
    sha256_files,
)
from dynabatch.features import FEATURE_NAMES

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
    return candidate_rows(frame)


def fit(rows: pd.DataFrame, args: argparse.Namespace):
    return fit_spike_classifier(rows, args.spike_ratio, max_iter=args.max_iter, learning_rate=args.learning_rate,
                                max_leaf_nodes=args.max_leaf_nodes)


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


def held_out(rows: pd.DataFrame, by: str, args: argparse.Namespace) -> dict:
    """For each value of column ``by`` (model or family): fit on the other rows, score its rows."""
    results = {}
    pooled_ratio, pooled_proba = [], []
    for group in sorted(rows[by].unique()):
        test = (rows[by] == group).to_numpy()
        train = rows[~test]
        if train.empty or train["ratio"].gt(args.spike_ratio).nunique() < 2:
            continue
        proba = fit(train, args).predict_proba(features_of(rows[test]))[:, 1]
        ratio = rows.loc[test, "ratio"].to_numpy()
        results[group] = metrics(ratio, proba, args.threshold, args.spike_ratio)
        pooled_ratio.append(ratio)
        pooled_proba.append(proba)
    if pooled_ratio:
        results["ALL"] = metrics(np.concatenate(pooled_ratio), np.concatenate(pooled_proba), args.threshold,
                                 args.spike_ratio)
    return results


def print_table(title: str, results: dict) -> None:
    print(title)
    head = f"{'held out':<16}{'rows':>6}{'spikes':>8}{'recall':>8}{'pred.safe':>10}{'false-safe':>11}" \
           f"{'ratio>1':>9}{'max ratio safe':>16}"
    print(head)
    print("-" * len(head))
    for group, m in results.items():
        mx = m["max_ratio_predicted_safe"]
        print(f"{group:<16}{m['rows']:>6}{m['spikes']:>8}{m['spike_recall']:>8.3f}{m['predicted_safe']:>10}"
              f"{m['false_safe_rate']:>11.4f}{m['over_budget_rate']:>9.4f}{('-' if mx is None else f'{mx:.3f}'):>16}")
    print()


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
    rows = load_rows(files)
    if rows["ratio"].gt(args.spike_ratio).nunique() < 2:
        raise SystemExit("the profiles hold only one class; profile more settings")
    results = {}
    if not args.skip_held_out:
        where = f"at threshold {args.threshold} (spike = measured ratio > {args.spike_ratio})"
        for by in ("model", "family"):
            results[by] = held_out(rows, by, args)
            print_table(f"leave-one-{by}-out {where}:", results[by])
    estimator = fit(rows, args)
    args.out.mkdir(parents=True, exist_ok=True)
    pkl = args.out / "classifier.pkl"
    joblib.dump(estimator, pkl)
    # A compact copy of the training rows ships with the package: if the pickle
    # cannot be used (another scikit-learn, a damaged file) dynabatch refits from it.
    profiles = args.out / "profiles.csv.gz"
    rows.loc[:, list(PROFILE_COLUMNS)].to_csv(profiles, index=False, compression={"method": "gzip", "mtime": 0})
    meta = {
        "sklearn_version": sklearn.__version__,
        "feature_names": list(FEATURE_NAMES),
        "monotonic_cst": MONOTONIC,
        "spike_ratio": args.spike_ratio,
        "threshold": args.threshold,
        "params": {"max_iter": args.max_iter, "learning_rate": args.learning_rate,
                   "max_leaf_nodes": args.max_leaf_nodes},
        "classifier_sha256": hashlib.sha256(pkl.read_bytes()).hexdigest(),
        "profiles_sha256": hashlib.sha256(profiles.read_bytes()).hexdigest(),
        "training_data": {
            "files": [f.name for f in files],
            "sha256": sha256_files(files),
            "rows": int(len(rows)),
            "spikes": int(rows["ratio"].gt(args.spike_ratio).sum()),
            "models": sorted(rows["model"].unique().tolist()),
            "families": sorted(rows["family"].unique().tolist()),
            "devices": sorted(rows["device"].unique().tolist()),
        },
        "trained_on": ", ".join(f"{d}:{m}" for d, m in sorted(set(zip(rows["device"], rows["model"])))),
        "held_out_metrics": results,
    }
    (args.out / "classifier.json").write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    logger.info("wrote %s, %s and %s", pkl, profiles, args.out / "classifier.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
