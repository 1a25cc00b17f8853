"""What a batch holds, read from the model's config: the prior of an absolute memory budget.

Before any batch has run, an absolute budget (``max_memory="90%"`` of a GPU's
free memory) needs bytes for a batch of ``rows`` rows padded to ``width``
tokens. A :class:`Footprint` adds up what the call holds, from the model's
config and the call's settings, per row (every term grows with the rows):

* **activations** of the forward over the prompt, at the peak of a layer:
  per token, the larger of the feed-forward's (``3 * hidden`` plus 2
  intermediate widths, 4 for a gated feed-forward, 4 more for an activation
  composed of several ops such as GPT-2's ``gelu_new``) and the attention's
  (``2 * hidden + 5 * (q + kv)`` widths: projections, rotary temporaries), in
  the weights' dtype; plus the attention mask (``width`` bytes a token), or the
  score matrices of an eager or relative-position attention (``3 * heads *
  width`` elements a token);
* for ``generate`` (``max_new_tokens > 0``): the **KV cache** through
  ``width + max_new_tokens`` positions (keys and values of every layer, one
  layer twice while a step grows it), and the **logits** of a step (the
  model's own, a float32 copy and the processed scores: ``vocab * (dtype + 8)``
  bytes a row); an encoder-decoder keeps the encoder's output and its
  cross-attention keys and values over ``width`` positions besides. Beams and
  ``num_return_sequences`` multiply the rows the decoder holds; what the call's
  logits processors, sampling and beam search copy of a step's logits besides
  (``step_bytes``, which ``dynabatch.generate`` measures) adds to a step.

The peak of a call is the larger of the prompt's forward and a decoding step,
each with what it holds then. On the CPU's storage tracker (float32, sdpa),
the measured peaks of Qwen2-, Llama-, GPT-2-, BERT- and Marian-shaped models
lie at 0.6-0.97 of these predictions over 4-128 rows and 4-256 tokens (below
0.6 only for calls of a few KB); on an
H200 (bfloat16), the Qwen2 of ``benchmarks/generation.py`` measured 0.91 of
the prediction (708 MiB for 192 prompts of 255 tokens and 64 new ones; 59 MiB
for 16). The budget keeps a margin for what no
tensor shows (the CUDA context, fragmentation).

Measured peaks refine it (:meth:`Footprint.observe`): a measured batch scales
the phase the prior says was the larger there to its measured ratio (the
largest so far; down to :data:`SCALE_FLOOR` of the prior at most), so a prior
that errs high lets batches grow once a batch has run, and one that errs low
is corrected by the first batch. After one measured batch, every other shape
of those models measured at most 1.12 of its prediction (1.05 but for
Llama's decoding steps): the budget's margin covers that. A shape that ran
out of memory caps the rows at its width and wider (the rule of
:mod:`dynabatch.memory.oom`).

Example:
    >>> from transformers import Qwen2Config
    >>> config = Qwen2Config(vocab_size=32_000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
    ...                      num_attention_heads=8, num_key_value_heads=2)
    >>> fp = Footprint.from_model(config, max_new_tokens=64, dtype="bfloat16")
    >>> round(float(fp.predict(192, 255)) / 2**20)  # an H200 measured 708 MiB for this call
    777
    >>> int(fp.max_rows(255, 2**30)), int(fp.max_rows(16, 2**30))  # rows of 255 and of 16 tokens in 1 GiB
    (253, 2045)
    >>> _ = fp.observe(192, 255, 708 * 2**20)  # a measured peak: predictions scale down to it
    >>> int(fp.max_rows(255, 2**30))
    277
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_non_negative_int, check_positive_int
from dynabatch.memory.budget import rows_under
from dynabatch.memory.oom import failed_cap
from dynabatch.memory.shape import text_config

__all__ = ["CALL_BYTES", "SCALE_FLOOR", "Footprint", "ModelDims"]

logger = logging.getLogger(__name__)

_FIELDS = {  # each dimension's config fields, in the order they are read
    "hidden": ("hidden_size", "d_model", "n_embd", "dim"),
    "intermediate": ("intermediate_size", "d_ff", "n_inner", "encoder_ffn_dim", "ffn_dim", "hidden_dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers"),
    "heads": ("num_attention_heads", "n_head", "decoder_attention_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
    "vocab": ("vocab_size",),
}
CALL_BYTES = 64 * 1024
"""What a call holds whatever its rows (positions, masks' small tensors, each rounded to the allocator's blocks)."""
SCALE_FLOOR = 0.75
"""Measured peaks scale a phase's prior down to this share of it at most: the priors err high by less (0.8-0.97 of
the measured peaks on the CPU), and a phase's ratio varies a little with the shape."""
_CALL_SHARE = 0.1  # a measured call refines the prior only where what any call holds is at most this share of it
_LOGIT_COPIES = 8  # bytes a logit besides the model's own: a float32 copy and the processed scores
_COMPOSED_ACTIVATIONS = frozenset({"gelu_new", "gelu_fast", "quick_gelu", "gelu_python", "gelu_10", "gelu_accurate"})
"""Activations transformers computes in several ops, each holding an intermediate-wide tensor."""
_GATES = ("gate_proj", "gate_up_proj", "w1", "wi_0")  # a gated feed-forward's gate projection, by module name


def _field(config: Any, dim: str) -> int | None:
    for name in _FIELDS[dim]:
        value = getattr(config, name, None)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
            return int(value)
    return None


@dataclass(frozen=True)
class ModelDims:
    """The sizes a batch's memory follows, read from a transformers config (:meth:`from_model`).

    Args:
        hidden: width of the hidden states.
        intermediate: width of the feed-forward's inner layer.
        layers: decoder layers (the layers of an encoder-only model).
        heads: attention heads.
        kv_heads: key and value heads (grouped-query attention), ``heads`` without it.
        head_dim: width of a head.
        vocab: rows of the output embedding.
        dtype_bytes: bytes of an activation (the weights' dtype).
        eager: whether attention materializes its score matrices (``attn_implementation="eager"``, or a
            relative position bias as T5's).
        encoder_decoder: whether the model encodes the prompt and decodes the reply apart.
        encoder_layers: the encoder's layers (encoder-decoder models).
        gated: whether the feed-forward is gated (a ``gate_proj``: Llama, Qwen, Mistral).
        composed_activation: whether the feed-forward's activation is several ops (``gelu_new``).
        logits_bias: whether the logits get a bias added (Marian's ``final_logits_bias``: one more copy).
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    eager: bool = False
    encoder_decoder: bool = False
    encoder_layers: int = 0
    gated: bool = False
    composed_activation: bool = False
    logits_bias: bool = False

    @classmethod
    def from_model(cls, model: Any, dtype: Any = None) -> ModelDims:
        """The sizes of a transformers model or config; ``dtype`` (default: the model's weights', else float32).

        Raises:
            TypeError: ``model`` has no config with a hidden size, layers, heads and a vocabulary.
        """
        config = text_config(model)
        found = {dim: _field(config, dim) for dim in _FIELDS}
        missing = [dim for dim in ("hidden", "layers", "heads", "vocab") if found[dim] is None]
        if missing:
            raise bad_type("model", "a transformers model or config with a hidden size, layers, attention heads "
                           f"and a vocabulary (missing: {', '.join(missing)})", model)
        hidden, heads = found["hidden"], found["heads"]
        head_dim = getattr(config, "head_dim", None)
        head_dim = int(head_dim) if isinstance(head_dim, numbers.Integral) and head_dim > 0 else max(1, hidden // heads)
        implementation = getattr(config, "_attn_implementation", None)  # None: a bare config, which models run in sdpa
        relative = getattr(config, "relative_attention_num_buckets", None) is not None
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        encoder_layers = int(getattr(config, "encoder_layers", 0) or getattr(config, "num_layers", 0) or 0)
        activation = str(getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or "")
        return cls(hidden=hidden, intermediate=found["intermediate"] or 4 * hidden, layers=found["layers"],
                   heads=heads, kv_heads=found["kv_heads"] or heads, head_dim=head_dim, vocab=found["vocab"],
                   dtype_bytes=_dtype_bytes(model, dtype), eager=implementation == "eager" or relative,
                   encoder_decoder=encoder_decoder, encoder_layers=encoder_layers if encoder_decoder else 0,
                   gated=_gated(model, config), composed_activation=activation in _COMPOSED_ACTIVATIONS,
                   logits_bias=getattr(model, "final_logits_bias", None) is not None)

    def token_bytes(self) -> int:
        """Activation bytes a prompt token holds at the peak of a layer's forward (the attention mask aside):
        the feed-forward's or the attention's, whichever holds more."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        widths = 2 + 2 * self.gated + 4 * self.composed_activation
        feed_forward = 3 * self.hidden + widths * self.intermediate
        attention = 2 * self.hidden + 5 * (q + kv)
        return self.dtype_bytes * max(feed_forward, attention)

    def kv_bytes(self) -> int:
        """Bytes the KV cache holds a token (keys and values of every decoder layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def _gated(model: Any, config: Any) -> bool:
    """Whether the feed-forward is gated: a gate projection among the model's modules, else (a config) a SiLU
    decoder (the Llama family's gated feed-forward)."""
    named = getattr(model, "named_modules", None)
    if callable(named):
        return any(name.rsplit(".", 1)[-1] in _GATES for name, _ in named())
    activation = getattr(config, "hidden_act", None)
    return activation in ("silu", "swish") and not getattr(config, "is_encoder_decoder", False)


def _dtype_bytes(model: Any, dtype: Any) -> int:
    if dtype is None:
        parameters = getattr(model, "parameters", None)
        first = next((p for p in parameters() if p.is_floating_point()), None) if callable(parameters) else None
        dtype = first.dtype if first is not None else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise bad_value("dtype", "None or a floating torch dtype (torch.bfloat16, 'float16')", dtype)
    return torch.empty((), dtype=dtype).element_size()


class Footprint:
    """Predicted peak bytes of a batch from the model's sizes, refined by measured peaks (see the module).

    Args:
        dims: the model's :class:`ModelDims`.
        max_new_tokens: tokens ``generate`` adds a row; 0 for a forward call.
        rows_per_prompt: rows the decoder holds a prompt (``num_beams``, or ``num_return_sequences``).
        step_bytes: bytes a prompt's rows hold at a decoding step besides the prior's (what the call's logits
            processors, sampling and beam search copy of the logits: ``generate`` measures it, as the slope of two
            small calls over the prior's); 0 for a forward call.

    Attributes:
        scales_: per phase (the prompt's forward, a decoding step), the largest measured peak over the prior's
            prediction of the batches where that phase was the larger (1.0 before any).
        failed_shapes: the ``(rows, width)`` shapes that ran out of memory.
    """

    def __init__(self, dims: ModelDims, *, max_new_tokens: int = 0, rows_per_prompt: int = 1,
                 step_bytes: int = 0) -> None:
        if not isinstance(dims, ModelDims):
            raise bad_type("dims", "a ModelDims (ModelDims.from_model(model))", dims)
        self.dims = dims
        self.max_new_tokens = check_non_negative_int("max_new_tokens", max_new_tokens)
        self.rows_per_prompt = check_positive_int("rows_per_prompt", rows_per_prompt)
        self.step_bytes = check_non_negative_int("step_bytes", step_bytes)
        self.scales_ = [1.0, 1.0]
        self._measured = [False, False]
        self.failed_shapes: list[tuple[int, int]] = []

    @classmethod
    def from_model(cls, model: Any, *, max_new_tokens: int = 0, num_beams: int = 1, num_return_sequences: int = 1,
                   dtype: Any = None, step_bytes: int = 0) -> Footprint:
        """The footprint of ``model`` (a transformers model or config) for a forward call (``max_new_tokens=0``)
        or a ``generate`` call of these settings (``step_bytes``: the class's)."""
        rows = max(check_positive_int("num_beams", num_beams), check_positive_int("num_return_sequences",
                                                                                   num_return_sequences))
        return cls(ModelDims.from_model(model, dtype), max_new_tokens=max_new_tokens, rows_per_prompt=rows,
                   step_bytes=step_bytes)

    # -- the prior ---------------------------------------------------------------------------------
    def phase_bytes(self, width: Any) -> tuple[np.ndarray, np.ndarray]:
        """The prior's bytes a row at padded ``width`` in each phase: the prompt's forward, and the decoding
        steps (zeros for a forward call); float64, broadcast, before :attr:`scales_`."""
        d = self.dims
        width = np.asarray(width, dtype=np.float64)
        attention = 3 * d.heads * width * d.dtype_bytes if d.eager else width  # a token's scores, or its mask row
        layer = width * (d.token_bytes() + attention)  # the prompt's forward, at the peak of a layer
        if not self.max_new_tokens:
            return layer, np.zeros_like(layer)
        k = self.rows_per_prompt
        own = d.dtype_bytes * (1 + d.logits_bias)  # the model's logits of a row's token, a bias added
        # a step's logits, a row: the model's, a float32 copy, and (decoding) the scores processed from the last step's
        logits = d.vocab * (own + (_LOGIT_COPIES if self.max_new_tokens > 1 else 4))
        step_kv = d.kv_bytes() * (1 + 1 / d.layers)  # a token's keys and values, one layer's copied as a step grows it
        if d.encoder_decoder:  # the encoder's output and every decoder layer's cross-attention keys and values
            held = width * k * d.dtype_bytes * d.hidden * (1 + 2 * d.layers)
            return layer, held + k * ((self.max_new_tokens + 1) * step_kv + logits) + self.step_bytes
        prompt = k * (width * d.kv_bytes() + np.maximum(layer, d.vocab * (own + 4)))
        return prompt, k * ((width + self.max_new_tokens) * step_kv + logits) + self.step_bytes

    def row_bytes(self, width: Any) -> np.ndarray:
        """Predicted bytes a row at padded ``width``: the larger phase, each scaled by what was measured."""
        prompt, decoding = self.phase_bytes(width)
        return np.maximum(self.scales_[0] * prompt, self.scales_[1] * decoding)

    # -- what a budget asks ------------------------------------------------------------------------
    def predict_unchecked(self, rows: Any, width: Any) -> np.ndarray:
        """:meth:`predict` without argument checks (float arrays in)."""
        return CALL_BYTES + np.asarray(rows, dtype=np.float64) * self.row_bytes(width)

    def predict(self, rows: Any, padded_length: Any) -> np.ndarray:
        """Predicted peak bytes of ``rows`` x ``padded_length`` batches (float64, broadcast)."""
        return self.predict_unchecked(_counts("rows", rows), _counts("padded_length", padded_length))

    def max_rows_unchecked(self, padded_length: Any, budget_bytes: Any) -> np.ndarray:
        """The most rows predicted at or under ``budget_bytes`` (closed form), failed shapes aside."""
        return rows_under(CALL_BYTES, self.row_bytes(padded_length), budget_bytes)

    def max_rows(self, padded_length: Any, budget_bytes: Any) -> np.ndarray:
        """The most rows at ``padded_length`` predicted at or under ``budget_bytes`` (0 if none), int64; below
        every shape that ran out of memory at that width or narrower."""
        width = _counts("padded_length", padded_length)
        rows = self.max_rows_unchecked(width, np.asarray(budget_bytes, dtype=np.float64))
        return np.minimum(rows, failed_cap(width, self.failed_shapes))

    # -- what the run tells it ---------------------------------------------------------------------
    def observe(self, rows: Any, padded_length: Any, peak_bytes: Any = None, *, out_of_memory: bool = False,
                **_: Any) -> Footprint:
        """A measured batch refines the phase the prior says was the larger there: its scale becomes the measured
        peak over the prior's prediction (the largest such ratio so far, so a phase errs high where its ratio
        varies); ``out_of_memory=True``: that shape failed."""
        rows = check_positive_int("rows", int(rows))
        width = check_positive_int("padded_length", int(padded_length))
        if out_of_memory:
            self.failed_shapes.append((rows, width))
            return self
        if isinstance(peak_bytes, bool) or not isinstance(peak_bytes, numbers.Real) or not (
                math.isfinite(peak_bytes) and peak_bytes > 0):
            return self  # a call that allocated nothing on the measured device says nothing of its memory
        phases = self.phase_bytes(width)
        phase = int(phases[1] > phases[0])
        if rows * phases[phase] < (1 / _CALL_SHARE - 1) * CALL_BYTES:
            return self  # a call too small to tell its rows' cost from what any call holds
        ratio = max(SCALE_FLOOR, (float(peak_bytes) - CALL_BYTES) / float(rows * phases[phase]))
        self.scales_[phase] = max(self.scales_[phase], ratio) if self._measured[phase] else ratio
        self._measured[phase] = True
        logger.debug("footprint: %d x %d measured %.0f bytes, %.2f of the prior's %s phase", rows, width, peak_bytes,
                     ratio, ("prompt", "decoding")[phase])
        return self

    def key(self) -> tuple[Any, ...]:
        """What identifies the predictions in a fingerprint."""
        return ("Footprint", self.dims, self.max_new_tokens, self.rows_per_prompt, self.step_bytes,
                tuple(self.scales_), sorted(self.failed_shapes))

    def __repr__(self) -> str:
        return (f"Footprint({self.dims!r}, max_new_tokens={self.max_new_tokens}, "
                f"rows_per_prompt={self.rows_per_prompt}, step_bytes={self.step_bytes}, "
                f"scales_={[round(s, 3) for s in self.scales_]})")


def _counts(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if not np.isfinite(arr).all() or (arr < 1).any():
        raise bad_value(name, "a count >= 1 (or an array of them)", value)
    return arr
