#!/usr/bin/env python3
"""Builds the built-in model's corpus and tokenizer from English text that Debian installs offline.

Sources (install with ``apt-get install -y fortunes python3-doc``):
  - the fortune databases, ``/usr/share/games/fortunes/*``: one document per fortune;
  - the Python documentation's reStructuredText sources, ``/usr/share/doc/python3.X/html/_sources/**/*.rst.txt``:
    one document per section (short sections merged), markup reduced to plain text.

Each document goes to a split by a hash of its text (so the split does not depend on file order, and a
fortune listed in two databases lands in one split): about 1% to the held-out evaluation text, 1.5% to
the validation text (early stopping), the rest to training. Exact duplicates are dropped.

Outputs:
  .corpus/train.txt, .corpus/valid.txt   git-ignored, regenerable; carried to the training machine
  .corpus/manifest.json                  sources, package versions, counts, sha256 of every output
  ktorch/builtin/eval.txt                the held-out evaluation text (committed)
  ktorch/builtin/tokenizer.json,         byte-level BPE trained on train.txt, with a transformers
  ktorch/builtin/tokenizer_config.json   wrapper (bos/eos, chat template)

Documents in the .txt files are separated by ``<|endoftext|>`` followed by a newline (see
``ktorch/builtin/evaluation.py:read_documents``). The training split also holds chat-formatted copies of a
third of its fortunes and of its documentation section openings, so ``ktorch chat`` answers in the template it was trained on.

    python scripts/build_corpus.py            # all of it
    python scripts/build_corpus.py --check    # rebuild in memory and compare with the files on disk
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS_DIR = REPO / ".corpus"
BUILTIN_DIR = REPO / "ktorch" / "builtin"

FORTUNES_DIR = "/usr/share/games/fortunes"
PYDOC_GLOB = "/usr/share/doc/python3.*/html/_sources"
# Pictures, not text; and databases whose point is not English prose.
SKIP_FORTUNE_DBS = {"ascii-art"}

EOT = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
VOCAB_SIZE = 4096
# Jinja chat template; chat_text() below writes the same format for the training documents.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

EVAL_PER_MILLE, VALID_PER_MILLE = 10, 15
MIN_SECTION_CHARS = 600
MAX_CHAT_ANSWER_CHARS = 800
CHAT_FORTUNE_SHARE = 3  # one fortune in this many gets a chat copy

FORTUNE_REQUESTS = (
    "Tell me a fortune.",
    "Say something funny.",
    "Give me a quote.",
    "Tell me a joke.",
    "Any wisdom for today?",
    "Surprise me.",
)


# ---------------------------------------------------------------- fortunes


def fortune_documents() -> list[tuple[str, str]]:
    """(source, text) of every fortune, in sorted database order."""
    docs = []
    for path in sorted(glob.glob(os.path.join(FORTUNES_DIR, "*"))):
        name = os.path.basename(path)
        if "." in name or name in SKIP_FORTUNE_DBS or not os.path.isfile(path):
            continue  # .dat indexes, .u8 links
        raw = Path(path).read_bytes().decode("utf-8", errors="replace")
        raw = re.sub(r".\x08", "", raw)  # overstrike (x BS x, _ BS x): keep the last character
        for i, text in enumerate(re.split(r"^%\n", raw, flags=re.M)):
            text = text.strip("\n")
            if text.strip():
                docs.append((f"fortunes/{name}#{i}", text + "\n"))
    return docs


# ---------------------------------------------------------------- python documentation

_UNDERLINE = re.compile(r"^([=\-~^*#\"'`+:.])\1{2,}\s*$")
_TABLE_RULE = re.compile(r"^\s*[=+\-]{3,}[=+\- ]*$")
_ROLE = re.compile(r":(?:[a-z]+:)?([a-z\-]+):`([^`]+)`")
_DROP_BLOCK = {
    "toctree", "testsetup", "testcleanup", "index", "highlight", "tabularcolumns", "module", "currentmodule",
    "moduleauthor", "sectionauthor", "include", "literalinclude", "image", "figure", "raw", "only", "audit-event",
    "productionlist", "csv-table", "list-table", "availability", "program", "cmdoption", "option", "envvar",
    "opcode", "pdbcommand", "sectionauthor", "rubric", "impl-detail", "c:namespace", "doctest", "testcode",
    "testoutput", "code-block", "sourcecode", "autoclass", "automodule", "miscnews",
}
_LABEL_DIRECTIVES = {
    "note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
    "caution": "Caution:", "tip": "Tip:", "hint": "Hint:", "attention": "Attention:", "danger": "Danger:",
}
_VERSION_DIRECTIVES = {
    "versionadded": "New in version", "versionchanged": "Changed in version", "deprecated": "Deprecated since version",
    "deprecated-removed": "Deprecated since version",
}


def _role_text(match: re.Match) -> str:
    role, text = match.group(1), match.group(2)
    link = re.match(r"^(.*?)\s*<[^>]*>$", text, flags=re.S)
    if link and link.group(1):
        text = link.group(1)
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return {"pep": f"PEP {text}", "rfc": f"RFC {text}", "issue": f"bpo-{text}", "gh": f"gh-{text}"}.get(role, text)


def _inline(line: str) -> str:
    line = _ROLE.sub(_role_text, line)
    line = re.sub(r"``(.+?)``", r"\1", line)
    line = re.sub(r"`([^`<]+?)\s*<[^>]+>`__?", r"\1", line)  # `text <url>`_
    line = re.sub(r"`([^`]+)`__?", r"\1", line)  # `text`_
    line = re.sub(r"\*\*(.+?)\*\*", r"\1", line)
    line = line.replace("\\ ", "")
    if line.rstrip().endswith("::"):
        line = line.rstrip()[:-1]
    return line


def rst_to_text(lines: list[str]) -> str:
    """Plain text of reStructuredText lines: roles, links and markup removed; directive lines kept where they
    carry words (signatures, version notes) and dropped with their bodies where they do not (toctree, index)."""
    out: list[str] = []
    skip_indent = None  # inside a dropped directive's body: its indentation
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if _UNDERLINE.match(line) or _TABLE_RULE.match(line) or stripped == "::":
            continue
        directive = re.match(r"^\s*\.\.\s+([\w:\-]+)::\s*(.*)$", line)
        if directive:
            name, args = directive.group(1), directive.group(2)
            bare = name.split(":")[-1]
            if name in _DROP_BLOCK or bare in _DROP_BLOCK:
                skip_indent = indent
            elif bare in _LABEL_DIRECTIVES:
                out.append(" " * indent + _LABEL_DIRECTIVES[bare] + (" " + _inline(args) if args else ""))
            elif bare in _VERSION_DIRECTIVES:
                out.append(" " * indent + f"{_VERSION_DIRECTIVES[bare]} {args.split()[0] if args else ''}.".rstrip())
            elif args:  # function, class, method, attribute, data, decorator, exception, describe, ...
                out.append(" " * indent + _inline(args))
            continue
        if re.match(r"^\s*\.\.\s", line) or stripped == "..":  # labels, comments, substitution definitions
            skip_indent = indent
            continue
        if re.match(r"^\s*:[\w\-]+:(\s|$)", line) and out and not out[-1].strip() == "":
            continue  # directive options (:synopsis:, :noindex:) and field lists right after a directive line
        out.append(_inline(line).rstrip())
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n" if text else ""


def _sections(lines: list[str]) -> list[list[str]]:
    """The file's lines cut before every section title (a line underlined by a repeated punctuation character)."""
    starts = [0]
    for i in range(1, len(lines) - 1):
        title, under = lines[i], lines[i + 1]
        if title.strip() and not title.startswith(" ") and _UNDERLINE.match(under) and len(under.rstrip()) >= len(title.rstrip()) - 1:
            start = i - 1 if i >= 1 and _UNDERLINE.match(lines[i - 1]) else i  # overlined title
            if start > starts[-1]:
                starts.append(start)
    return [lines[a:b] for a, b in zip(starts, starts[1:] + [len(lines)])]


def pydoc_root() -> str:
    roots = sorted(glob.glob(PYDOC_GLOB), key=lambda p: [int(x) for x in re.findall(r"\d+", p)])
    if not roots:
        sys.exit(f"build_corpus: no Python documentation sources at {PYDOC_GLOB}; apt-get install -y python3-doc")
    return roots[-1]


def pydoc_documents() -> list[tuple[str, str]]:
    """(source, text) of every documentation section (sections shorter than MIN_SECTION_CHARS merged into the next)."""
    root = pydoc_root()
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True)):
        rel = os.path.relpath(path, root)
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
        pending = ""
        for i, section in enumerate(_sections(lines)):
            pending += rst_to_text(section)
            if len(pending) >= MIN_SECTION_CHARS:
                docs.append((f"pydoc/{rel}#{i}", pending))
                pending = ""
            elif pending:
                pending += "\n"
        if pending.strip():
            docs.append((f"pydoc/{rel}#end", pending.rstrip("\n") + "\n"))
    return docs


# ---------------------------------------------------------------- split, chat copies, outputs


def split_of(text: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") % 1000
    if bucket < EVAL_PER_MILLE:
        return "eval"
    if bucket < EVAL_PER_MILLE + VALID_PER_MILLE:
        return "valid"
    return "train"


def chat_text(messages: list[dict[str, str]]) -> str:
    """The chat template (CHAT_TEMPLATE) rendered without the leading bos, which the document separator provides."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def chat_documents(fortunes: list[str], sections: list[str]) -> list[str]:
    """Chat-formatted training copies: a request answered by a fortune; "Explain <title>." answered by a section opening."""
    docs = []
    for text in fortunes:
        digest = hashlib.sha256(text.encode()).digest()
        if digest[1] % CHAT_FORTUNE_SHARE:
            continue
        request = FORTUNE_REQUESTS[digest[0] % len(FORTUNE_REQUESTS)]
        docs.append(chat_text([{"role": "user", "content": request}, {"role": "assistant", "content": text.strip()}]))
    for text in sections:
        title, _, body = text.partition("\n")
        title = re.sub(r"\s+---\s+.*$", "", title.strip())  # "functools --- Higher-order functions" -> "functools"
        body = body.strip()
        if not title or len(body) < 200:
            continue
        cut = body[:MAX_CHAT_ANSWER_CHARS]
        if len(body) > MAX_CHAT_ANSWER_CHARS:
            cut = cut[: cut.rfind("\n\n")] if "\n\n" in cut else cut[: cut.rfind(". ") + 1]
        if cut.strip():
            docs.append(chat_text([{"role": "user", "content": f"Explain {title}."}, {"role": "assistant", "content": cut.strip()}]))
    return docs


def join_documents(docs: list[str]) -> str:
    return "".join(d + EOT + "\n" for d in docs)


def build_texts() -> tuple[dict[str, str], dict]:
    """The train/valid/eval texts and the manifest (without output hashes)."""
    fortunes, pydoc = fortune_documents(), pydoc_documents()
    seen: set[str] = set()
    splits: dict[str, list[str]] = {"train": [], "valid": [], "eval": []}
    train_fortunes, train_sections = [], []
    counts = {}
    for kind, docs in (("fortunes", fortunes), ("pydoc", pydoc)):
        for _, text in docs:
            if text in seen:
                continue
            seen.add(text)
            split = split_of(text)
            splits[split].append(text)
            counts[f"{kind}/{split}"] = counts.get(f"{kind}/{split}", 0) + 1
            if split == "train":
                (train_fortunes if kind == "fortunes" else train_sections).append(text)
    chat = chat_documents(train_fortunes, train_sections)
    counts["chat/train"] = len(chat)
    texts = {name: join_documents(docs) for name, docs in splits.items()}
    texts["train"] += join_documents(chat)
    manifest = {
        "sources": {"fortunes": FORTUNES_DIR, "pydoc": pydoc_root()},
        "packages": _package_versions(["fortunes", "fortunes-min", "python3-doc", os.path.basename(os.path.dirname(os.path.dirname(pydoc_root()))) + "-doc"]),
        "documents": counts,
        "chars": {name: len(t) for name, t in texts.items()},
    }
    return texts, manifest


def _package_versions(names: list[str]) -> dict[str, str]:
    versions = {}
    for name in dict.fromkeys(names):
        try:
            versions[name] = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            versions[name] = "unknown"
    return versions


def train_tokenizer(train_text: str):
    """Byte-level BPE with VOCAB_SIZE entries (special tokens first), trained on the training documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = [d for d in train_text.split(EOT + "\n") if d]
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    eot_id = tokenizer.token_to_id(EOT)
    # A bos (= eos) before every encoded text, as every training document follows the previous one's eos.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """tokenizer.json plus the transformers wrapper files (PreTrainedTokenizerFast) in ``out_dir``."""
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    wrapper = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    wrapper.save_pretrained(str(out_dir))
    # The chat template must give exactly the format the chat training documents use.
    probe = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    rendered = wrapper.apply_chat_template(probe, tokenize=False)
    assert rendered == EOT + chat_text(probe), f"chat template renders {rendered!r}"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", type=Path, default=CORPUS_DIR, help="where train.txt/valid.txt go (default: .corpus/)")
    parser.add_argument("--builtin-dir", type=Path, default=BUILTIN_DIR, help="where eval.txt and the tokenizer go")
    parser.add_argument("--no-tokenizer", action="store_true", help="write the texts only; keep the existing tokenizer")
    parser.add_argument("--check", action="store_true", help="rebuild the texts in memory and compare with the files")
    args = parser.parse_args(argv)

    texts, manifest = build_texts()
    targets = {"train": args.corpus_dir / "train.txt", "valid": args.corpus_dir / "valid.txt", "eval": args.builtin_dir / "eval.txt"}
    manifest["sha256"] = {name: _sha256(t) for name, t in texts.items()}
    if args.check:
        bad = [str(p) for name, p in targets.items() if not p.exists() or _sha256(p.read_text(encoding="utf-8")) != manifest["sha256"][name]]
        print("build_corpus: " + ("differs: " + ", ".join(bad) if bad else "all texts match"))
        return 1 if bad else 0

    args.corpus_dir.mkdir(parents=True, exist_ok=True)
    for name, path in targets.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(texts[name], encoding="utf-8")
        print(f"{path}: {len(texts[name]) / 1e6:.2f} M chars")
    if not args.no_tokenizer:
        tokenizer = train_tokenizer(texts["train"])
        save_tokenizer(tokenizer, args.builtin_dir)
        for name in ("train", "valid", "eval"):
            ids = sum(len(e.ids) for e in tokenizer.encode_batch(texts[name].split(EOT + "\n"), add_special_tokens=False))
            manifest.setdefault("tokens", {})[name] = ids
        manifest["tokenizer_sha256"] = hashlib.sha256((args.builtin_dir / "tokenizer.json").read_bytes()).hexdigest()
        print(f"tokenizer: {tokenizer.get_vocab_size()} entries; tokens {manifest['tokens']}")
    (args.corpus_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest["documents"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
