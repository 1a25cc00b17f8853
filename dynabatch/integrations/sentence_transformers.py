"""sentence-transformers on dynamic batches: :func:`encode`, and :func:`make_dynamic` for code that calls ``model.encode``.

:func:`encode` takes ``SentenceTransformer.encode``'s arguments and returns what
it returns (numpy array, tensor, list of tensors or dicts; one vector for a
single string), but runs the model through :func:`dynabatch.run`: texts are
tokenized once by the model's own rules (its ``preprocess``: its tokenizer, its
``max_seq_length``, the prompt prepended as sentence-transformers does), sorted
longest first, and ``batch_size`` is the first batch's rows: later batches grow
as the texts get shorter, under the first batch's measured peak memory, with
out-of-memory splitting. The model runs its own modules (``model(features)``:
its Transformer, its Pooling mode, its Normalize), so the vectors are the
model's own; they match ``model.encode``'s within float rounding.

:func:`make_dynamic` makes a model's own ``encode`` (and so ``encode_query``,
``encode_document`` and every library calling it: MTEB, LangChain, LlamaIndex)
run this way, unchanged for the caller.

What runs on dynamic batches: a ``SentenceTransformer`` whose first module is
a ``Transformer`` with a tokenizer, on str inputs. sentence-transformers' other
kinds (``SparseEncoder``, ``MultiVectorEncoder``, ``CrossEncoder``) are refused
by every function here with a ``TypeError`` naming what to call instead. Other inputs (pairs, images,
chat messages) and models (a ``Router`` first, chat-template backbones,
flash-attention flattening, which has no padding to save, ColBERT query
expansion) are refused by :func:`encode`, naming the reason; a model made
dynamic passes them to its original ``encode``, with a warning once.

Differences from ``model.encode``, by rule: the per-token values of
``output_value=None`` are cut to each row's own tokens, where ``model.encode``
keeps the padding of the row's batch, right or left, whose width depends on
the batch (``token_embeddings`` are the row's own tokens in both, cut by the
attention mask); ``device`` takes one device or a list of them (``["cuda:0", "cuda:1"]``: a model copy
per device, run through :func:`dynabatch.run`'s ``devices=``, threads not processes), and
``pool`` and ``chunk_size`` (sentence-transformers' worker processes) are refused.

``sentence_transformers`` is imported when a function runs: importing this module does not need it.

Example:
    >>> from sentence_transformers import SentenceTransformer
    >>> from dynabatch.integrations import sentence_transformers as dst
    >>> from dynabatch.demo import kjv_passages, minilm_path
    >>> model = SentenceTransformer(minilm_path(), device="cpu")
    >>> texts = kjv_passages()[:64]
    >>> vectors = dst.encode(model, texts, batch_size=8)
    >>> vectors.shape, vectors.dtype.name, bool(abs(vectors - model.encode(texts, batch_size=8)).max() < 1e-5)
    ((64, 384), 'float32', True)
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int, did_you_mean
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.inference.outputs import PerRow
from dynabatch.inference.runner import run
from dynabatch.memory.shape import check_position_limit, position_limit

__all__ = ["corpus_embedder", "encode", "length_limit", "make_dynamic", "resolve_prompt"]

logger = logging.getLogger(__name__)

_UNPADDED = {"common": {"return_tensors": None}, "text": {"padding": False}}  # rows as lists: dynabatch pads
_PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary", None)  # None: float32, as model.encode reads it
_OUTPUTS = ("sentence_embedding", "token_embeddings", None)


_OTHER_KINDS = ("call model.encode for a SparseEncoder or a MultiVectorEncoder, model.predict or model.rank for a "
                "CrossEncoder")


def _check_model(model: Any) -> None:
    """Refuses a model that is no ``SentenceTransformer``: sentence-transformers' other kinds (``SparseEncoder``,
    ``MultiVectorEncoder``, ``CrossEncoder``) give what dynabatch does not build (sparse vectors, a vector per token,
    scores of pairs), and run on dynamic batches they failed late (a ``KeyError`` after the first batch ran, an
    ``AttributeError``) or, made dynamic, lost the ``encode`` they had."""
    from sentence_transformers.sentence_transformer.model import SentenceTransformer  # the class, wherever re-exported

    if not isinstance(model, SentenceTransformer):
        raise bad_type("model", f"a sentence_transformers.SentenceTransformer (dynabatch runs its dense sentence "
                       f"embeddings; {_OTHER_KINDS})", model)


def _unsupported(model: Any, inputs: list[Any]) -> str | None:
    """Why ``model.encode(inputs)`` cannot run on dynamic batches, or ``None`` when it can."""
    from sentence_transformers.base.modules import Transformer

    first = model[0] if len(model) else None
    if not isinstance(first, Transformer):
        return f"its first module is a {type(first).__name__}, not a Transformer"
    if first.tokenizer is None:
        return "its Transformer module has no tokenizer"
    if "message" in first.modality_config:
        return "it renders its inputs through a chat template"
    if getattr(first, "can_flatten_inputs", False):
        return "it flattens batches for flash-attention (no padding to save)"
    if getattr(first, "query_expansion", None) is not None:
        return "it expands queries to a fixed width"
    for i, item in enumerate(inputs):
        if not isinstance(item, str):
            return f"inputs[{i}] is a {type(item).__name__}, not a str"
    return None


_PROBES = ([""], ["a probe of the values every batch shares", "b"])
"""Two calls of different rows and widths: what ``preprocess`` returns besides rows must be the same for both."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # no plain equality: not provably the same
        return False


def _weightless(model: Any) -> Any:
    """A copy of ``model`` for its ``preprocess`` alone: every parameter and buffer on the meta device (no bytes
    copied), so that a copy of the tokenizer (a streaming loader's, a worker process's) never copies the weights."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(torch.empty_like(parameter, device="meta"),
                                                 requires_grad=parameter.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


class _Preprocessor:
    """The model's own tokenization (``model.preprocess``) as the loader's tokenizer: unpadded rows.

    What ``preprocess`` returns besides rows (``modality``, ``prompt_length``)
    is read here, once, by probe calls in the calling process (:attr:`constants`):
    the model call adds it to every batch, whichever copy of this tokenizer
    (a streaming loader's, a worker process's) tokenized the batch. It must be
    the same for every batch: a model whose probes differ is refused naming the
    value, and every call checks its own values against the probe's. A copy
    or a pickled one carries the model without its weights (:func:`_weightless`).
    """

    def __init__(self, model: Any, prompt: str | None, limit: int | None, kwargs: dict[str, Any]) -> None:
        tokenizer = model.tokenizer
        self.model, self.prompt, self.kwargs = model, prompt, dict(kwargs)
        processing = {key: dict(value) for key, value in (self.kwargs.pop("processing_kwargs", None) or {}).items()}
        for key, value in _UNPADDED.items():
            processing[key] = {**processing.get(key, {}), **value}
        if limit is not None:  # the tokenizer sets no limit: cut at the model's positions
            processing["text"].setdefault("max_length", limit)
        self.processing = processing
        self.pad_token_id = tokenizer.pad_token_id
        self.padding_side = tokenizer.padding_side
        self.pad_token_type_id = getattr(tokenizer, "pad_token_type_id", 0)
        first, second = (self._split(probe)[1] for probe in _PROBES)
        differing = sorted(key for key in first.keys() | second.keys() if not _same(first.get(key), second.get(key)))
        if differing:
            raise ValueError(f"model should give the same {differing} for every batch from its preprocess (dynabatch "
                             f"tokenizes apart from the model call), but got {first} and {second} for two batches: "
                             "call model.encode for it")
        self.constants = first

    def limit(self, planned: int) -> int:
        """The longest row ``preprocess`` gives: its truncation is the model's own (its Transformer's
        ``processing_kwargs`` or ``query_length`` may set a ``max_length`` other than ``max_seq_length``), so it is
        read from a row of more words than ``planned`` (then, where that is not cut, than the model's positions: a
        long probe, which costs a model of 128k positions a quarter of a second, only where needed), as tokenized;
        ``planned`` where no probe is cut, or where the Transformer sets no length of its own (no probe runs)."""
        first = self.model[0]
        own = (getattr(first, "processing_kwargs", None) or {}).get("text") or {}
        if "max_length" not in own and all(getattr(first, name, None) is None
                                           for name in ("query_length", "document_length")):
            return planned  # preprocess cuts at max_seq_length, the positions (cut) or the call's own max_length
        found = position_limit(first.auto_model)
        for words in sorted({planned + 8, max(planned, found[2] if found else 0) + 8}):
            length = len(self._split([" ".join(["a"] * words)])[0]["input_ids"][0])
            if length < words:
                return length
        return planned

    def _split(self, texts: list[str]) -> tuple[dict[str, list], dict[str, Any]]:
        """``preprocess``'s output for ``texts``: ``(rows, the values besides rows)``."""
        out = self.model.preprocess(texts, prompt=self.prompt, processing_kwargs=self.processing, **self.kwargs)
        rows = {key: value for key, value in out.items() if isinstance(value, list)}
        return rows, {key: value for key, value in out.items() if key not in rows}

    def __call__(self, texts: list[str], **_: Any) -> dict[str, list]:  # dynabatch's truncation: the model's own
        rows, constants = self._split(texts)
        for key in constants.keys() | self.constants.keys():
            if not _same(constants.get(key), self.constants.get(key)):
                raise ValueError(f"model.preprocess(texts)[{key!r}] should be the same for every batch, but got "
                                 f"{constants.get(key)!r} where a probe gave {self.constants.get(key)!r}: call "
                                 "model.encode for it")
        return rows

    def __getstate__(self) -> dict[str, Any]:  # pickled for a worker process: no weights
        return {**self.__dict__, "model": _weightless(self.model)}

    def __deepcopy__(self, memo: dict[int, Any]) -> _Preprocessor:  # a streaming loader's copy: no weights
        clone = copy.copy(self)
        clone.__dict__.update(copy.deepcopy({**self.__dict__, "model": None}, memo), model=_weightless(self.model))
        return clone


def length_limit(model: Any) -> tuple[int, int | None]:
    """``(planning limit, truncation limit or None)``: the model's ``max_seq_length``, else its positions.

    Raises:
        ValueError: a model of neither (a relative-position encoder whose tokenizer sets no ``model_max_length``):
            set ``model.max_seq_length``.
    """
    limit = model.max_seq_length
    if isinstance(limit, int) and 0 < limit < 10**9:
        return limit, None
    found = position_limit(model[0].auto_model)
    if found is None:
        raise bad_value("model.max_seq_length", "set (its tokenizer and config give no length limit)", limit)
    return found[2], found[2]


_READINGS = {"sentence_embedding": "whole", "token_embeddings": "per_token", None: "per_token"}
"""How :func:`dynabatch.run` reads each output's tensors: pooled vectors whole, per-token ones cut by the mask."""


def _row_outputs(features: dict[str, Any], output_value: str | None, normalize: bool, truncate_dim: int | None) -> Any:
    """What one batch gives, as ``model.encode`` computes it for the batch (rows split by ``run``'s rule)."""
    from sentence_transformers.util import truncate_embeddings

    if truncate_dim is not None:
        features["sentence_embedding"] = truncate_embeddings(features["sentence_embedding"], truncate_dim)
    if output_value == "sentence_embedding":
        embeddings = features["sentence_embedding"]
        return torch.nn.functional.normalize(embeddings, p=2, dim=1) if normalize else embeddings
    if output_value == "token_embeddings":
        return features["token_embeddings"]
    rows = features["attention_mask"].shape[0]
    out = {}
    for name, value in features.items():  # per-token tensors as they are: run cuts them by the attention mask
        if name == "sentence_embedding":  # pooled, whatever its size (it may equal the batch's width)
            out[name] = PerRow(value.unbind(0))
        elif isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == rows:
            out[name] = value
        else:  # the same for every row (modality, prompt_length), as encode gives it
            out[name] = PerRow([value] * rows)
    return out


def _check_arguments(output_value: Any, precision: Any, batch_size: Any, device: Any, pool: Any, chunk_size: Any,
                     tokenize_cores: Any) -> None:
    if output_value not in _OUTPUTS:
        raise bad_value("output_value", f"one of {_OUTPUTS}", output_value)
    if precision not in _PRECISIONS:
        raise bad_value("precision", f"one of {_PRECISIONS}", precision)
    if output_value is None and precision not in ("float32", None):  # model.encode raises, once every batch ran
        raise bad_value("precision", "'float32' or None with output_value=None (sentence-transformers' "
                        "quantize_embeddings takes no per-row dicts: model.encode raises on them)", precision)
    check_positive_int("batch_size", batch_size)
    if isinstance(device, (list, tuple)) and not device:
        raise bad_value("device", "None, a device, or a list of at least one device", device)
    if pool is not None:
        raise bad_value("pool", "None (a multi-process pool is sentence-transformers' own; dynabatch runs one "
                        "device)", pool)
    if chunk_size is not None:  # sentence-transformers' inputs per worker process, where dynabatch runs none
        raise bad_value("chunk_size", "None (sentence-transformers' inputs sent to a worker process at a time; "
                        "dynabatch runs no worker process: every device takes the next batch as it ends one, so "
                        "pass no chunk_size)", chunk_size)
    if tokenize_cores is not None:  # the loader's rule, checked before the model moves or an empty list returns
        check_positive_int("tokenize_cores", tokenize_cores)


def _check_model_kwargs(model: Any, kwargs: dict[str, Any]) -> None:
    """``kwargs`` refused as ``model.encode`` refuses them (a keyword the model does not use): passed on unchecked,
    a misspelt argument (``normalise_embeddings``) would be dropped by ``preprocess`` and the vectors differ."""
    taken = {"task", "processing_kwargs", *model.get_model_kwargs()}
    unknown = sorted(set(kwargs) - taken)
    if unknown:
        name = unknown[0]
        raise TypeError(f"encode() got an unexpected keyword argument {name!r}"
                        f"{did_you_mean(name, taken | set(inspect.signature(encode).parameters))}: it is no argument "
                        f"of encode and no keyword of the model ({sorted(taken)}); but got {name}={kwargs[name]!r}")


def _as_inputs(model: Any, sentences: Any) -> tuple[list[Any], bool]:
    singular = model.is_singular_input(sentences)
    if singular:
        return [sentences], True
    if isinstance(sentences, np.ndarray):
        return sentences.tolist(), False
    return (sentences if isinstance(sentences, list) else list(sentences)), False


def resolve_prompt(model: Any, prompt: str | None, prompt_name: str | None) -> str | None:
    """The prompt as ``model.encode`` resolves it (``prompt``, else ``prompts[prompt_name]``, else the default)."""
    if prompt is not None:
        return prompt
    if prompt_name is not None:
        if prompt_name not in model.prompts:
            raise bad_value("prompt_name", f"one of the model's prompts {sorted(model.prompts)}", prompt_name)
        return model.prompts[prompt_name]
    return model.prompts.get(model.default_prompt_name) if model.default_prompt_name is not None else None


def _show_progress(show_progress_bar: bool | None) -> bool:
    if show_progress_bar is not None:
        return bool(show_progress_bar)
    level = logging.getLogger("sentence_transformers.sentence_transformer.model").getEffectiveLevel()
    return level in (logging.INFO, logging.DEBUG)  # as model.encode decides


def _run_rows(model: Any, inputs: list[str], prompt: str | None, batch_size: int, output_value: str | None,
              normalize: bool, truncate_dim: int | None, device: torch.device, progress: bool,
              run_options: dict[str, Any], kwargs: dict[str, Any], devices: list | None = None,
              tokenize_cores: int | None = None) -> list[Any]:
    """One result per input, in input order, from the model run on dynamic batches."""
    planning_limit, cut = length_limit(model)
    preprocessor = _Preprocessor(model, prompt, cut, kwargs)
    called = ((kwargs.get("processing_kwargs") or {}).get("text") or {}).get("max_length")  # a call's own limit
    planning_limit = called or planning_limit
    # named as the caller set it: the loader would name its own max_input_token_length, no argument of encode
    name = "processing_kwargs['text']['max_length']" if called else "model.max_seq_length"
    check_position_limit(model[0].auto_model, planning_limit, length_name=name)
    planning_limit = preprocessor.limit(planning_limit)
    constants = preprocessor.constants  # what every batch shares (prompt_length): values, read once
    loader = build_dynamic_batch_dataloader(inputs, preprocessor, batch_size, planning_limit, num_workers=0,
                                            progress=progress, model=model.transformers_model,
                                            tokenize_cores=tokenize_cores)
    forward_kwargs = dict(kwargs)
    forward_kwargs.pop("processing_kwargs", None)

    def rows(batch: Any) -> Any:
        features = model({**batch, **constants}, **forward_kwargs)
        return _row_outputs(features, output_value, normalize, truncate_dim)

    if devices is None:
        with torch.inference_mode():
            return run(rows, loader, device=device, progress=progress, token_outputs=_READINGS[output_value],
                       **run_options)

    def make_rows(target: torch.device) -> Any:  # one model copy per accelerator; CPU threads share the model
        on = model if target == device else copy.deepcopy(model).to(target)

        def rows_on(batch: Any) -> Any:
            with torch.inference_mode():  # thread-local: entered in the device's worker thread
                features = on({**batch, **constants}, **forward_kwargs)
                return _row_outputs(features, output_value, normalize, truncate_dim)

        return rows_on

    return run(loader=loader, make_fn=make_rows, devices=devices, progress=progress,
               token_outputs=_READINGS[output_value], **run_options)


def corpus_embedder(model: Any, *, prompt_name: str | None = None, prompt: str | None = None,
                    normalize_embeddings: bool = False,
                    ) -> tuple[Any, int, Callable[[torch.device], Callable[[Any], torch.Tensor]]]:
    """What a job over a corpus needs to run ``model`` through :func:`dynabatch.run` as :func:`encode` runs it.

    For a loader over a corpus (``read_texts``, ``ids=``) and a results store,
    where :func:`encode` takes a list and returns arrays: the vectors are the
    model's own (its tokenization, prompt, pooling and Normalize module).

    Args:
        model: a ``SentenceTransformer`` whose inputs run on dynamic batches (see :func:`encode`).
        prompt_name, prompt: the prompt prepended to every text, resolved as
            ``encode`` resolves it (``prompt``, else ``model.prompts[prompt_name]``,
            else the model's default prompt).
        normalize_embeddings: scale every vector to unit length (after the model's own modules).

    Returns:
        ``(tokenizer, max_input_token_length, make_fn)``: the model's own
        tokenization as the loader's tokenizer, the loader's length limit (the
        model's ``max_seq_length``), and ``make_fn(device)`` giving
        ``fn(batch)``, the batch's sentence embeddings (the model itself on its
        own device, a copy on any other), for ``run(..., token_outputs="whole")``.

    Raises:
        TypeError: a model that is no ``SentenceTransformer`` (a ``SparseEncoder``, ``CrossEncoder``,
            ``MultiVectorEncoder``).
        ValueError: a model that does not run on dynamic batches (the reason named), or a ``prompt_name``
            the model has no prompt for.

    Example:
        >>> from sentence_transformers import SentenceTransformer
        >>> import dynabatch
        >>> from dynabatch.demo import minilm_path
        >>> model = SentenceTransformer(minilm_path(), device="cpu")
        >>> tokenizer, limit, make_fn = corpus_embedder(model)
        >>> texts = ["In the beginning", "And God said"]
        >>> loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, 2, limit, num_workers=0,
        ...                                                   progress=False)
        >>> rows = dynabatch.run(make_fn(model.device), loader, token_outputs="whole", progress=False)
        >>> bool((rows.numpy() - model.encode(texts)).__abs__().max() < 1e-5)
        True
    """
    _check_model(model)
    reason = _unsupported(model, [])
    if reason is not None:
        raise ValueError(f"model should run its inputs on dynamic batches, but {reason}: call model.encode for it")
    limit, cut = length_limit(model)
    preprocessor = _Preprocessor(model, resolve_prompt(model, prompt, prompt_name), cut, {})
    limit = preprocessor.limit(limit)
    constants = preprocessor.constants  # what every batch shares (prompt_length): values, read once
    model.eval()

    def make_fn(device: torch.device) -> Callable[[Any], torch.Tensor]:
        on = model if torch.device(device) == model.device else copy.deepcopy(model).to(device)

        def fn(batch: Any) -> torch.Tensor:
            with torch.inference_mode():  # thread-local: entered in the thread that runs the batch
                features = on({**batch, **constants})
                return _row_outputs(features, "sentence_embedding", normalize_embeddings, model.truncate_dim)

        return fn

    return preprocessor, limit, make_fn


def encode(
    model: Any,
    sentences: Any,
    prompt_name: str | None = None,
    prompt: str | None = None,
    batch_size: int = 32,
    show_progress_bar: bool | None = None,
    output_value: str | None = "sentence_embedding",
    precision: str = "float32",
    convert_to_numpy: bool = True,
    convert_to_tensor: bool = False,
    device: str | torch.device | None = None,
    normalize_embeddings: bool = False,
    truncate_dim: int | None = None,
    pool: Any = None,
    chunk_size: int | None = None,
    *,
    on_oom: str = "raise",
    memory: str = "auto",
    tokenize_cores: int | None = None,
    **kwargs: Any,
) -> Any:
    """``model.encode(sentences, ...)`` on dynamic batches: the same arguments, the same return value.

    Args:
        model: a ``sentence_transformers.SentenceTransformer``.
        sentences: a str, or a list (tuple, numpy array, ``datasets`` column) of str.
        prompt_name, prompt, show_progress_bar, output_value, precision,
            convert_to_numpy, convert_to_tensor, normalize_embeddings, truncate_dim:
            as ``SentenceTransformer.encode`` takes them.
        batch_size: rows of the first (longest) batch; later batches grow under its measured peak.
        device: one device (the model is moved there, as ``encode`` does); ``None``: the model's; a list:
            every device at once (the model moved to the first, a copy on each other accelerator).
        pool, chunk_size: both ``None``: sentence-transformers' worker processes (a pool, the inputs sent to a
            process at a time) are its own; every device here takes the next batch as it ends one.
        on_oom, memory: :func:`dynabatch.run`'s.
        tokenize_cores: cores to tokenize the texts on, at most (the loader's; the vectors are the same);
            ``None``: every core this process may use.
        **kwargs: the model's own keywords (``task``, ``processing_kwargs``, ``model.get_model_kwargs()``),
            passed to its ``preprocess`` and forward as ``encode`` passes them; any other is refused.

    Returns:
        What ``model.encode`` returns: a 2-D numpy array (``convert_to_numpy``),
        one tensor (``convert_to_tensor``, on the model's device), a list of
        tensors, or for ``output_value="token_embeddings"`` / ``None`` a list of
        per-row tensors (numpy arrays, quantized, for a ``precision``) / dicts; the row alone for a single str.

    Raises:
        TypeError: a model that is no ``SentenceTransformer`` (a ``SparseEncoder``, ``CrossEncoder``,
            ``MultiVectorEncoder``: what to call instead named), or a keyword that is no argument of ``encode``
            and no keyword of the model.
        ValueError: inputs or a model that do not run on dynamic batches (the
            reason named: use ``model.encode``), an empty list of devices, a ``pool``, a ``chunk_size``,
            or a bad ``output_value``, ``precision`` (any but float32 with ``output_value=None``), ``prompt_name``,
            ``batch_size`` or ``tokenize_cores``.
    """
    from sentence_transformers.util import quantize_embeddings

    _check_model(model)
    _check_arguments(output_value, precision, batch_size, device, pool, chunk_size, tokenize_cores)
    _check_model_kwargs(model, kwargs)
    if convert_to_tensor:
        convert_to_numpy = False
    if output_value != "sentence_embedding":
        convert_to_tensor = convert_to_numpy = False
    inputs, singular = _as_inputs(model, sentences)
    reason = _unsupported(model, inputs)
    if reason is not None:
        raise ValueError(f"model should run its inputs on dynamic batches, but {reason}: call model.encode for it")
    if not inputs:  # nothing to batch: what encode gives for no input
        return type(model).encode(model, inputs, batch_size=batch_size, output_value=output_value,
                                  convert_to_numpy=convert_to_numpy, convert_to_tensor=convert_to_tensor)
    devices = [torch.device(d) for d in device] if isinstance(device, (list, tuple)) else None
    target = _inference_device(model, devices[0] if devices else device)  # moves the model, as encode does
    model.eval()
    truncate_dim = truncate_dim if truncate_dim is not None else model.truncate_dim
    progress = _show_progress(show_progress_bar)
    rows = _run_rows(model, inputs, resolve_prompt(model, prompt, prompt_name), batch_size, output_value,
                     normalize_embeddings, truncate_dim, target,
                     progress, {"on_oom": on_oom, "memory": memory}, kwargs, devices, tokenize_cores)
    if output_value != "sentence_embedding":
        embeddings: Any = [_on(row, target) for row in rows]
    else:
        embeddings = torch.stack(list(rows)).to(target)
    if precision not in ("float32", None):  # token rows too: one numpy array each, calibrated over every token
        embeddings = quantize_embeddings(embeddings, precision=precision)
    if output_value == "sentence_embedding":
        if convert_to_tensor:
            embeddings = torch.as_tensor(embeddings)
        elif convert_to_numpy:
            if isinstance(embeddings, torch.Tensor):
                embeddings = (embeddings.float() if embeddings.dtype == torch.bfloat16 else embeddings).cpu().numpy()
        else:
            embeddings = list(torch.from_numpy(embeddings) if isinstance(embeddings, np.ndarray) else embeddings)
    return embeddings[0] if singular else embeddings


def _inference_device(model: Any, device: Any) -> torch.device:
    """The device ``model.encode`` would run on, the model moved there as ``encode`` moves it.

    sentence-transformers 6.2 resolves it in the private ``_resolve_inference_device`` (which also
    leaves a model placed by a device map or accelerate hooks where it is); before it, ``encode``
    moved the model to ``device`` (``None``: where it is).
    """
    resolve = getattr(model, "_resolve_inference_device", None)
    if callable(resolve):
        return resolve(device)
    if device is not None:
        model.to(device)
    return model.device


def _on(row: Any, device: torch.device) -> Any:
    if isinstance(row, torch.Tensor):
        return row.to(device)
    if isinstance(row, dict):
        return {key: _on(value, device) for key, value in row.items()}
    return row


class _DynamicEncode:
    """A model's ``encode`` on dynamic batches (what :func:`make_dynamic` puts on the instance).

    A module-level callable holding the model, so that ``copy.deepcopy`` and
    pickling the model carry it over to the copy (a closure would keep calling
    the original model).
    """

    def __init__(self, model: Any, options: dict[str, Any]) -> None:
        self.model = model
        self.options = options
        self.warned: set[str] = set()
        self.__signature__ = inspect.signature(type(model).encode.__get__(model))

    @property
    def original(self) -> Any:
        """The model class's own ``encode``, bound to the model."""
        return type(self.model).encode.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "sentences" in kwargs:  # the name encode took before "inputs"
            kwargs["inputs"] = kwargs.pop("sentences")
        named = self.__signature__.bind(*args, **kwargs).arguments
        named = {**named.pop("kwargs", {}), **named}
        inputs, _ = _as_inputs(self.model, named["inputs"])
        reason = _unsupported(self.model, inputs)
        if reason is not None:
            if reason not in self.warned:
                self.warned.add(reason)
                logger.warning("model.encode runs on fixed batches here, since %s", reason)
            return self.original(*args, **kwargs)
        return encode(self.model, named.pop("inputs"), **named, **self.options)


def make_dynamic(model: Any, **options: Any) -> Any:
    """Makes ``model.encode`` run on dynamic batches (:func:`encode`); returns the model.

    The instance's ``encode`` is replaced (its class is left alone), so
    ``encode_query``, ``encode_document`` and any code calling ``model.encode``
    (MTEB, LangChain, LlamaIndex) get dynamic batches unchanged; its signature
    is the original's. Inputs or a model :func:`encode` refuses go to the
    original ``encode``, with a warning once per reason. ``model.encode.original``
    is the original method; a copy of the model (``copy.deepcopy``, pickling)
    stays dynamic, on its own weights.

    Args:
        model: a ``sentence_transformers.SentenceTransformer``.
        **options: :func:`encode`'s own options for every call (``on_oom``, ``memory``, ``tokenize_cores``).

    Raises:
        TypeError: an option it does not take, or a model that is no ``SentenceTransformer`` (a
            ``SparseEncoder``, ``CrossEncoder``, ``MultiVectorEncoder``: its ``encode`` is left as it was).

    Example:
        >>> from sentence_transformers import SentenceTransformer
        >>> from dynabatch.demo import minilm_path
        >>> from dynabatch.integrations.sentence_transformers import make_dynamic
        >>> model = make_dynamic(SentenceTransformer(minilm_path(), device="cpu"))
        >>> model.encode(["In the beginning", "And God said"]).shape
        (2, 384)
    """
    unknown = sorted(set(options) - {"on_oom", "memory", "tokenize_cores"})
    if unknown:
        raise TypeError(f"make_dynamic() got unexpected keyword arguments {unknown}: it takes on_oom, memory and "
                        "tokenize_cores")
    _check_model(model)
    model.encode = _DynamicEncode(model, options)
    return model
