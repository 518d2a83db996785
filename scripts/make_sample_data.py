"""Regenerate data/sample_corpus.jsonl and data/tokenizer/ deterministically (CC0, generated text).

The corpus is made of short "reports" written from a small grammar, with a long-tailed length mix,
so a tiny model can learn it in a few dozen steps and documents of very different lengths exist.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
SUBJECTS = ["the river", "a small engine", "the old library", "our team", "the northern station", "every valve",
            "the archive", "a quiet market", "the signal", "the harbour crane", "this garden", "the survey"]
VERBS = ["carries", "records", "measures", "repairs", "follows", "opens", "counts", "protects", "returns", "sorts"]
OBJECTS = ["the morning freight", "twelve letters", "a narrow bridge", "the spare parts", "the weekly totals",
           "a long corridor", "the winter stores", "three lanterns", "the printed maps", "the water level"]
TAILS = ["before noon", "without delay", "after the storm", "near the gate", "as planned", "once more",
         "for the second time", "in the evening", "along the coast", "under clear skies"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}."


def document(rng: random.Random, idx: int) -> str:
    n = max(1, min(600, int(rng.lognormvariate(2.3, 1.1))))
    return f"Report {idx}. " + " ".join(sentence(rng) for _ in range(n))


def main() -> None:
    rng = random.Random(1234)
    DATA.mkdir(exist_ok=True)
    docs = [document(rng, i) for i in range(400)]
    docs += ["", "   \n  "]  # kept on purpose: the packer's rule for empty documents is exercised by the demo
    with open(DATA / "sample_corpus.jsonl", "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(DATA / "tokenizer")
    print(f"{len(docs)} documents, {sum(map(len, docs))} characters, vocab {len(fast)}")


if __name__ == "__main__":
    main()
