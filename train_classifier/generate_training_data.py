"""Profiles real transformers models and writes the spike classifier's training data.

For every run (model x max_input_length x base batch size x text sample) the
texts are tokenized with truncation and sorted longest first. The first batch
is the ``base`` longest texts; then, at positions along the sorted list where
the texts are a given fraction of the longest, candidate batches of about 1x to
8x ``base`` rows are run for real (``generate`` for encoder-decoder and
decoder-only models, the forward pass for encoders) and their peak activation
memory is measured with :mod:`dynabatch.memory.measure`. At each position the
candidates go up in size until two in a row exceed the first batch's peak, so
both sides of the 0.9 boundary are seen without spending time deep in the
unsafe region.

Every row holds raw measurements only (features are computed at training time
by :func:`dynabatch.memory.features.compute_features`). A candidate above the token
cap (compute time) or the memory cap (host memory) is written with its status
(``token_cap`` / ``memory_cap``) and no peak: skipped and counted, never
invented.

Models are built from transformers configs with random weights (memory depends
on shapes, not on trained values) with realistic widths and vocabularies (30k
to 256k) and reduced depth, plus the real all-MiniLM-L6-v2 weights. Settings
off the defaults (beams, attention kernels, dtype, new tokens) are recorded in
every row and written to files of their own (``cpu-marian-2l-beams4-eager.csv.gz``).

Example:
    python train_classifier/generate_training_data.py --models minilm-l6 \
        --max-input-lengths 128 --base-batch-sizes 4 --out /tmp/profiles
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pandas as pd
import torch

from dynabatch.data.collate import TokenCollator
from dynabatch.demo import joke_texts, kjv_passages, minilm_path, vary_lengths
from dynabatch.memory.oom import call_guarded
from dynabatch.memory.units import GIB
from dynabatch.data.tokenization import tokenize_texts

logger = logging.getLogger("generate_training_data")

DATA_DIR = Path(__file__).resolve().parent / "data"
LENGTH_FRACTIONS = (1.0, 0.75, 0.5, 0.3, 0.15, 0.05)
MULTIPLES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
BASE_BATCH_SIZES = (1, 4, 8, 64, 128, 256, 512)
MAX_INPUT_LENGTHS = (128, 256, 512)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How to build one profiled model."""

    name: str
    family: str
    kind: str  # "encoder" | "encoder-decoder" | "decoder"
    build: Callable[[], torch.nn.Module]
    token_cap: int  # most padded tokens one call may run on this machine's CPU

    @property
    def task(self) -> str:
        return "forward" if self.kind == "encoder" else "generate"


def _random_init(config_cls, model_cls, **config) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return model_cls(config_cls(**config))

    return build


def _minilm() -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(minilm_path())


def model_specs() -> dict[str, ModelSpec]:
    """The profiled models: realistic widths and vocabularies, reduced depth."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        M2M100Config,
        M2M100ForConditionalGeneration,
        MarianConfig,
        MarianMTModel,
        Qwen2Config,
        Qwen2ForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    specs = [
        ModelSpec("minilm-l6", "bert", "encoder", _minilm, token_cap=32768),
        ModelSpec(
            "xlm-r-base-2l",
            "xlm-roberta",
            "encoder",
            _random_init(XLMRobertaConfig, XLMRobertaModel, vocab_size=250002, hidden_size=768, num_hidden_layers=2,
                         num_attention_heads=12, intermediate_size=3072, max_position_embeddings=1026,
                         pad_token_id=1),
            token_cap=32768,
        ),
        ModelSpec(
            "bart-base-2l",
            "bart",
            "encoder-decoder",
            _random_init(BartConfig, BartForConditionalGeneration, vocab_size=50265, d_model=768, encoder_layers=2,
                         decoder_layers=2, encoder_ffn_dim=3072, decoder_ffn_dim=3072, encoder_attention_heads=12,
                         decoder_attention_heads=12, max_position_embeddings=1024, pad_token_id=0,
                         eos_token_id=102, decoder_start_token_id=0, forced_eos_token_id=None),
            token_cap=16384,
        ),
        ModelSpec(
            "nllb-2l",
            "m2m100",
            "encoder-decoder",
            _random_init(M2M100Config, M2M100ForConditionalGeneration, vocab_size=256206, d_model=1024,
                         encoder_layers=2, decoder_layers=2, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                         encoder_attention_heads=16, decoder_attention_heads=16, max_position_embeddings=1024,
                         pad_token_id=0, eos_token_id=102, decoder_start_token_id=0),
            token_cap=8192,
        ),
        ModelSpec(
            "qwen2-0.5b-1l",
            "qwen2",
            "decoder",
            _random_init(Qwen2Config, Qwen2ForCausalLM, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=1, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=0, eos_token_id=102,
                         bos_token_id=101),
            token_cap=8192,
        ),
        ModelSpec(
            "bert-base-2l",
            "bert",
            "encoder",
            _random_init(BertConfig, BertModel, vocab_size=30522, hidden_size=768, num_hidden_layers=2,
                         num_attention_heads=12, intermediate_size=3072, max_position_embeddings=1024),
            token_cap=32768,
        ),
        ModelSpec(
            "marian-2l",
            "marian",
            "encoder-decoder",
            _random_init(MarianConfig, MarianMTModel, vocab_size=58101, d_model=512, encoder_layers=2,
                         decoder_layers=2, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                         encoder_attention_heads=8, decoder_attention_heads=8, max_position_embeddings=1024,
                         pad_token_id=0, eos_token_id=102, decoder_start_token_id=0),
            token_cap=16384,
        ),
        ModelSpec(
            "t5-small-2l",
            "t5",
            "encoder-decoder",
            _random_init(T5Config, T5ForConditionalGeneration, vocab_size=32128, d_model=512, d_kv=64, d_ff=2048,
                         num_layers=2, num_decoder_layers=2, num_heads=8, pad_token_id=0, eos_token_id=102,
                         decoder_start_token_id=0),
            token_cap=16384,
        ),
        ModelSpec(
            "gpt2-2l",
            "gpt2",
            "decoder",
            _random_init(GPT2Config, GPT2LMHeadModel, vocab_size=50257, n_embd=768, n_layer=2, n_head=12,
                         n_positions=1024, pad_token_id=0, eos_token_id=102, bos_token_id=101),
            token_cap=16384,
        ),
        ModelSpec(
            "llama-1l",
            "llama",
            "decoder",
            _random_init(LlamaConfig, LlamaForCausalLM, vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
                         max_position_embeddings=2048, pad_token_id=0, eos_token_id=102, bos_token_id=101),
            token_cap=16384,
        ),
    ]
    return {s.name: s for s in specs}


@dataclasses.dataclass
class Shape:
    """Shape of one measured batch."""

    position: int
    batch_size: int
    token_size: int
    total_tokens: int

    @property
    def paddings(self) -> int:
        return self.batch_size * self.token_size - self.total_tokens


class Runner:
    """Runs one model on batches of tokenized texts and measures peak activation memory."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 max_new_tokens: int, memory_cap: int | None, num_beams: int = 1,
                 attn_implementation: str | None = None) -> None:
        self.spec = spec
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.memory_cap = memory_cap
        self.num_beams = num_beams
        self.model = spec.build().to(device=device, dtype=dtype).eval()
        if attn_implementation is not None:
            self.model.set_attn_implementation(attn_implementation)
        self.padding_side = "left" if spec.kind == "decoder" else "right"

    def inputs(self, collator: TokenCollator, positions: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch at ``positions``, padded by dynabatch's own collator, as the model gets it."""
        batch = collator(positions)
        return {key: batch[key].to(self.device) for key in ("input_ids", "attention_mask")}

    def _call(self, inputs: dict[str, torch.Tensor]):
        if self.spec.task == "forward":
            return self.model(**inputs)
        return self.model.generate(**inputs, max_new_tokens=self.max_new_tokens,
                                   min_new_tokens=self.max_new_tokens, do_sample=False, num_beams=self.num_beams)

    def measure(self, inputs: dict[str, torch.Tensor]) -> tuple[str, int | None, float]:
        """Returns (status, peak bytes or None, seconds)."""
        limit = self.memory_cap if self.device.type == "cpu" else None
        start = time.perf_counter()
        with torch.inference_mode():
            attempt = call_guarded(self._call, inputs, measure_on=self.device, limit_bytes=limit, finish=_drop)
        if attempt.error is not None:
            return "memory_cap", None, time.perf_counter() - start
        return "ok", attempt.peak_bytes, time.perf_counter() - start


def _drop(output) -> None:
    """The call's output is not kept: only its peak memory is."""
    return None


def profile_run(runner: Runner, texts: list[str], tokenizer, max_len: int, base: int,
                token_cap: int) -> list[dict]:
    """Measures the first batch and the candidates of one run; returns the rows."""
    tokenized = tokenize_texts(texts, tokenizer, max_len)
    collator = TokenCollator(tokenized, pad_token_id=tokenizer.pad_token_id, padding_side=runner.padding_side)
    order = np.argsort(-tokenized.lengths, kind="stable")  # longest first, as the planner sorts
    lengths = tokenized.lengths[order]

    def shape(pos: int, size: int) -> Shape:
        rows = lengths[pos : pos + size]
        return Shape(pos, len(rows), int(rows.max()), int(rows.sum()))

    def measure(pos: int, size: int) -> tuple[str, int | None, float]:
        return runner.measure(runner.inputs(collator, order[pos : pos + size]))

    first = shape(0, base)
    if first.batch_size * first.token_size > token_cap:
        logger.info("skip run: first batch %dx%d above token cap", first.batch_size, first.token_size)
        return []
    measure(0, base)  # warm-up: lazily built buffers are not counted in what follows
    status, first_peak, secs = measure(0, base)
    if status != "ok":
        logger.info("skip run: first batch over memory cap")
        return []
    rows = [(first, status, first_peak, secs)]
    positions = []
    for frac in LENGTH_FRACTIONS:
        hits = np.nonzero(lengths[base:] <= frac * first.token_size)[0]
        if len(hits):
            positions.append(base + int(hits[0]))
    for pos in sorted(set(positions)):
        sizes = sorted({min(math.ceil(m * base), len(order) - pos) for m in MULTIPLES})
        over = 0
        for size in sizes:
            cand = shape(pos, size)
            if cand.batch_size * cand.token_size > token_cap:
                rows.append((cand, "token_cap", None, 0.0))
                continue
            status, peak, secs = measure(pos, size)
            rows.append((cand, status, peak, secs))
            over = over + 1 if status != "ok" or peak > first_peak else 0
            if over == 2:
                break
    return [
        {
            "position": b.position,
            "batch_size": b.batch_size,
            "token_size": b.token_size,
            "total_tokens": b.total_tokens,
            "paddings": b.paddings,
            "status": st,
            "peak_bytes": pk,
            "seconds": round(s, 4),
            "first_batch_size": first.batch_size,
            "first_token_size": first.token_size,
            "first_total_tokens": first.total_tokens,
            "first_paddings": first.paddings,
            "first_peak_bytes": first_peak,
        }
        for b, st, pk, s in rows
    ]


def settings_suffix(args: argparse.Namespace) -> str:
    """File-name part for settings off the defaults, so runs with other settings get files of their own."""
    parts = []
    if args.num_beams != 1:
        parts.append(f"beams{args.num_beams}")
    if args.attn_implementation:
        parts.append(args.attn_implementation)
    if args.dtype != "float32":
        parts.append(args.dtype)
    if args.max_new_tokens != 8:
        parts.append(f"new{args.max_new_tokens}")
    return "".join(f"-{p}" for p in parts)


TEXT_SOURCES = ("kjv", "kjv-varied", "jokes", "jokes-varied")


def run_texts(source: str, n: int, seed: int) -> list[str]:
    """A sample of ``n`` real texts: KJV passages or pyjokes' jokes as they are, or cut to 1-500 words."""
    if source not in TEXT_SOURCES:
        raise ValueError(f"text source should be one of {TEXT_SOURCES}, but got source={source!r}")
    passages = kjv_passages() if source.startswith("kjv") else joke_texts()
    if source.endswith("-varied"):
        return vary_lengths(passages, n=n, max_words=500, seed=seed)
    rng = np.random.default_rng(seed)
    return [passages[i] for i in rng.choice(len(passages), size=n, replace=len(passages) < n)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    specs = model_specs()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(specs),
                   help=f"comma-separated models to profile (default: all of {', '.join(specs)})")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run and measure (default: cpu)")
    p.add_argument("--num-beams", type=int, default=1, help="beam search width for generate (default: 1, greedy)")
    p.add_argument("--attn-implementation", default=None, choices=["sdpa", "eager"],
                   help="attention kernels (default: the model's own, sdpa in transformers 5)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model and activation dtype (default: float32)")
    p.add_argument("--max-input-lengths", default=",".join(map(str, MAX_INPUT_LENGTHS)),
                   help="comma-separated truncation limits (default: 128,256,512)")
    p.add_argument("--base-batch-sizes", default=",".join(map(str, BASE_BATCH_SIZES)),
                   help="comma-separated first-batch sizes; runs whose first batch is over the token cap are "
                        "skipped (default: 1,4,8,64,128,256,512)")
    p.add_argument("--sources", default="kjv-varied,kjv",
                   help="text samples: 'kjv' (passages as they are), 'jokes' (pyjokes, 13 languages) and their "
                        "'-varied' forms (cut or joined to 1-500 words log-uniformly); settings take them in turn "
                        "(default: kjv-varied,kjv)")
    p.add_argument("--every-source", action="store_true",
                   help="profile every setting on every source instead of taking sources in turn")
    p.add_argument("--n-texts", type=int, default=3000, help="texts per run (default: 3000)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per row, forced (default: 8)")
    p.add_argument("--token-scale", type=float, default=1.0,
                   help="multiplies each model's per-call token cap (compute time); use >1 on a GPU (default: 1)")
    p.add_argument("--memory-cap-gib", type=float, default=6.0,
                   help="CPU only: a call holding more activation memory than this many GiB (2**30 bytes) is "
                        "stopped and recorded as memory_cap (default: 6)")
    p.add_argument("--seed", type=int, default=0, help="seeds text sampling (default: 0)")
    p.add_argument("--out", type=Path, default=DATA_DIR,
                   help=f"folder for one <device>-<model>.csv.gz per model (default: {DATA_DIR})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(specs))
    if unknown:
        p.error(f"--models has unknown names {unknown}; choose from {sorted(specs)}")
    unknown = sorted(set(args.sources.split(",")) - set(TEXT_SOURCES))
    if unknown:
        p.error(f"--sources has unknown names {unknown}; choose from {list(TEXT_SOURCES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    memory_cap = int(args.memory_cap_gib * GIB) if device.type == "cpu" else None
    max_lens = [int(x) for x in args.max_input_lengths.split(",")]
    bases = [int(x) for x in args.base_batch_sizes.split(",")]
    sources = args.sources.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    specs = model_specs()
    for name in args.models.split(","):
        spec = specs[name]
        runner = Runner(spec, device, dtype, args.max_new_tokens, memory_cap, args.num_beams,
                        args.attn_implementation)
        token_cap = int(spec.token_cap * args.token_scale)
        frames = []
        run_id = 0
        settings = [(max_len, base) for max_len in max_lens for base in bases]
        for index, (max_len, base) in enumerate(settings):
            for source in sources if args.every_source else [sources[index % len(sources)]]:
                seed = args.seed + run_id
                texts = run_texts(source, args.n_texts, seed)
                start = time.perf_counter()
                rows = profile_run(runner, texts, tokenizer, max_len, base, token_cap)
                run_id += 1
                if not rows:
                    continue
                frame = pd.DataFrame(rows)
                frame.insert(0, "run", f"{device.type}-{name}-{run_id}")
                for col, val in [("model", name), ("family", spec.family), ("kind", spec.kind),
                                 ("task", spec.task), ("device", device.type), ("dtype", args.dtype),
                                 ("attn_implementation", runner.model.config._attn_implementation),
                                 ("num_beams", args.num_beams if spec.task == "generate" else 1),
                                 ("max_new_tokens", args.max_new_tokens if spec.task == "generate" else 0),
                                 ("max_input_length", max_len), ("base_batch_size", base),
                                 ("text_source", source), ("seed", seed),
                                 ("hidden_size", runner.model.config.get_text_config().hidden_size),
                                 ("vocab_size", runner.model.config.get_text_config().vocab_size)]:
                    frame.insert(frame.shape[1], col, val)
                frames.append(frame)
                counts = frame["status"].value_counts().to_dict()
                logger.info("%s max_len=%d base=%d %s: %s in %.1fs", name, max_len, base, source, counts,
                            time.perf_counter() - start)
        if frames:
            path = args.out / f"{device.type}-{name}{settings_suffix(args)}.csv.gz"
            pd.concat(frames, ignore_index=True).to_csv(path, index=False)
            logger.info("wrote %s", path)
        del runner
    return 0


if __name__ == "__main__":
    sys.exit(main())
