"""The shipped sample corpus and tokenizer, regenerated deterministically (``hf-longctx sample-data``).

Why generated text: it can be dedicated to the public domain (CC0 1.0) without doubt, it needs no
network, and its structure can be chosen to suit long-context training. Every document declares a
few facts at its start (a keeper, a code, a place) and repeats them near its end, so a model only
predicts those tokens well if it attends far back; lengths follow a long-tailed mix (most
documents short, a few far longer than a demo row) so packing splits some of them. A handful of
empty and whitespace-only documents are kept on purpose: they exercise the packer's rule for them.

The tokenizer is a byte-level BPE (``tokenizers``) trained on the corpus, saved as a transformers
``PreTrainedTokenizerFast`` with ``<s>``, ``</s>``, ``<pad>`` and ``<unk>``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_SIZE = 2000
NUM_DOCUMENTS = 300
# a few documents far longer than the rest ({index: sentences}), so packing into demo rows must split them and a
# length mix has a long bucket to draw from
LONG_DOCUMENTS = {17: 700, 88: 1100, 161: 1600, 242: 2300}
SEED = 20261122

_NOUNS = (
    "anchor archive arrow axle badge barge barrel basin beacon bell bench blanket boat boiler bolt bottle bracket "
    "bread bridge bucket cabin cable camp canal candle canvas cart cellar chain chapel chart chimney cistern clock "
    "coat compass copper corridor cottage crane crate current dam deck depot ditch dock door drum dune engine "
    "ferry field fence flag flask forge fountain furnace garden gate gauge glacier granary gravel hammer harbour "
    "hatch hearth helmet hill hinge horn inn island jetty kettle kiln ladder lamp lantern ledger lens lever "
    "library lighthouse lock loom map market meadow mill mine mirror motor net notebook oar orchard oven paddle "
    "pantry parcel pasture path pier pipe plank plough pond post pulley pump quarry quay rail raft ramp reel "
    "ridge river road roof rope rudder sail scale school shed shelf shovel signal sluice spring stable stair "
    "station stove stream street tank tavern tent terrace thread tide timber tool tower track trail tram "
    "trough tunnel valve vault wagon wall warehouse well wharf wheel whistle window winch wire workshop yard"
).split()
_VERBS = (
    "carries records measures repairs follows opens counts protects returns sorts builds checks cleans closes "
    "crosses delivers drains feeds fills finds gathers guards heats inspects joins lifts loads lowers marks mends "
    "moves paints plants pulls raises reads rebuilds seals sends sharpens signals spots stacks stores sweeps tests "
    "tows trims turns unloads visits washes weighs winds"
).split()
_ADJECTIVES = (
    "ancient bright broken busy calm careful clean cold crooked damp dark deep dry dusty early empty faint "
    "familiar far final flat fresh frozen gentle golden grey green hidden high hollow huge iron late lean "
    "little lonely long loud low narrow new noisy northern old pale patient plain proud quiet rapid rough "
    "rusty salty sharp short silent slow small smooth soft southern spare steady steep stone straight strong "
    "sturdy tall thin tidy tired upper useful warm weary western wet wide wild wooden worn young"
).split()
_ADVERBS = (
    "again already carefully early gladly gently late later nearly never often once quickly quietly rarely "
    "slowly soon steadily still together twice"
).split()
_TIMES = (
    "before noon|after the storm|at dawn|at dusk|in the evening|during the thaw|before the frost|on market day|"
    "after the flood|in early spring|in late autumn|at the turn of the tide|before the ferry left|by lamplight|"
    "under clear skies|in the rain|on the first of the month|after the bell"
).split("|")
_SYLLABLES = (
    "ar bel bran cal dor el fen gar hal is jor kel lin mar nor ol pen quil ros sel tam ul var wen yor zan "
    "bro cra dun fal gris hol kin lor mel nes ost pra rid sto thal ven wyn"
).split()
_TITLES = "keeper warden clerk pilot surveyor miller smith mason ferryman archivist".split()


def _name(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _phrase(rng: random.Random) -> str:
    adj = f"{rng.choice(_ADJECTIVES)} " if rng.random() < 0.6 else ""
    return f"the {adj}{rng.choice(_NOUNS)}"


def _sentence(rng: random.Random, people: list[str], places: list[str]) -> str:
    r = rng.random()
    who = rng.choice(people) if r < 0.35 else _phrase(rng)
    tail = f" {rng.choice(_TIMES)}" if rng.random() < 0.5 else ""
    where = f" near {rng.choice(places)}" if rng.random() < 0.3 else ""
    how = f" {rng.choice(_ADVERBS)}" if rng.random() < 0.3 else ""
    count = f" {rng.randint(2, 99)} times" if rng.random() < 0.1 else ""
    text = f"{who} {rng.choice(_VERBS)} {_phrase(rng)}{where}{how}{count}{tail}."
    return text[0].upper() + text[1:]


def _document(rng: random.Random, idx: int, sentences: int | None = None) -> str:
    """One document: a header of facts, paragraphs of sentences, and a closing line that recalls the header."""
    keeper, title = _name(rng, rng.choice([2, 3])), rng.choice(_TITLES)
    code = f"{rng.choice(_SYLLABLES).upper()}-{rng.randint(100, 999)}"
    home = keeper
    while home.startswith(keeper):
        home = _name(rng, 2) + rng.choice(["", " Bay", " Ford", " Hollow", " Reach", " Point"])
    people = [keeper] + [_name(rng, 2) for _ in range(rng.randint(1, 4))]
    places = [home] + [_name(rng, 2) for _ in range(rng.randint(1, 3))]
    n = max(1, min(400, int(rng.lognormvariate(2.6, 1.2))))
    n = sentences or n
    kind = rng.choice(["Report", "Ledger", "Logbook", "Letter"])
    lines = [f"{kind} {idx} of {home}. Written by {keeper}, {title}. Code {code}."]
    para: list[str] = []
    for i in range(n):
        para.append(_sentence(rng, people, places))
        if len(para) >= rng.randint(3, 8) or i == n - 1:
            lines.append(" ".join(para))
            para = []
        if rng.random() < 0.02:
            lines.append(f"{keeper} notes that {home} still holds code {code}.")
    lines.append(f"End of {kind.lower()} {idx}. Signed, {keeper} of {home}, code {code}.")
    return "\n".join(lines)


def sample_documents(num_documents: int = NUM_DOCUMENTS, seed: int = SEED) -> list[str]:
    """The corpus texts: generated documents (a few of them long) plus one empty and two whitespace-only ones."""
    rng = random.Random(seed)
    docs = [_document(rng, i, LONG_DOCUMENTS.get(i)) for i in range(num_documents)]
    for pos, text in zip((3, 150, 280), ("", "   \n  ", "\t")):
        docs.insert(pos, text)
    return docs


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts`` (any text encodes, no unknowns)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def write_sample_data(out_dir: str | Path) -> dict:
    """Write ``sample_corpus.jsonl`` and ``tokenizer/`` into ``out_dir``; returns a short description."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = sample_documents()
    with open(out / "sample_corpus.jsonl", "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = train_tokenizer([d for d in docs if d.strip()])
    tokenizer.save_pretrained(str(out / "tokenizer"))
    config_path = out / "tokenizer" / "tokenizer_config.json"  # a class name transformers 4 and 5 both load
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    lengths = [len(ids) for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]]
    return {"documents": len(docs), "characters": sum(map(len, docs)), "tokens": sum(lengths),
            "longest_document_tokens": max(lengths), "vocab_size": len(tokenizer)}
