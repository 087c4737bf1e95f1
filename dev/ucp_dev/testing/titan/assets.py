"""Tiny, generated tokenizer and dataset for torchtitan runs (nothing is downloaded): :func:`make_assets`,
and the synthetic documents it trains on (:func:`texts`, which the dataloader tests read directly)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a checkpoint resumes training at another scale shards tensors ranks layers optimizer moments "
    "pipeline stages experts tokens window cursor global batch data parallel tensor parallel load save "
    "model weights gradient step loss learning rate schedule warmup atoms fragments catalog patterns"
).split()


def texts(n: int, seed: int) -> list[str]:
    """``n`` short synthetic documents (``doc <i>: ...``), the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(8, 60)
        out.append(f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(k)) + ".")
    return out


def make_assets(folder: str | Path, n_docs: int = 2000, seed: int = 0) -> Path:
    """``folder/tokenizer/{tokenizer.json,tokenizer_config.json}`` (a byte-level BPE trained on the
    synthetic text) and ``folder/dataset/data.json`` (JSON lines of ``{"text": ...}``, readable by
    torchtitan's ``c4_test`` loader); kept when both exist. Deterministic for a given seed."""
    folder = Path(folder)
    tok_dir, data_dir = folder / "tokenizer", folder / "dataset"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "data.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = texts(n_docs, seed)
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    with open(data_dir / "data.json", "w") as f:
        for t in docs:
            f.write(json.dumps({"text": t}) + "\n")
    return folder
