"""The bare package (no extra): ``import dynabatch`` and the README's Python API, ``build_dynamic_batch_dataloader``
(with its bundled planner's files) and ``run``, on a word-level tokenizer and an embedding made here (no extra
installs a model). Run by .ci/wheel_check.sh in a clean virtual environment holding only the wheel and its
dependencies."""

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import dynabatch

words = "in the beginning god created the heaven and the earth".split()
vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(words))}}
core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
core.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")
texts = [" ".join(words[: 1 + i % len(words)]) for i in range(200)]

loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=8, max_input_token_length=16)
embed = torch.nn.Embedding(len(vocab), 4)
with torch.inference_mode():
    rows = dynabatch.run(lambda batch: (embed(batch["input_ids"]) * batch["attention_mask"][..., None]).sum(1),
                         loader, progress=False)
    want = torch.stack([embed(torch.tensor(tokenizer(t)["input_ids"])).sum(0) for t in texts])
assert "site-packages" in dynabatch.__file__, f"dynabatch imported from {dynabatch.__file__}, not the wheel"
assert len(rows) == len(texts) and torch.allclose(torch.stack(list(rows)), want, atol=1e-5), "rows out of order"
print(f"dynabatch {dynabatch.__version__} from {dynabatch.__file__}: {rows.report.batches} batches, "
      f"{len(rows)} rows in input order")
