"""Checkpoints in: a local Hugging Face dir (safetensors only), a .gguf file, or a hub id.

Weights are read with safetensors. Pickled ``.bin`` / ``.pt`` files are refused: unpickling a
file from an untrusted directory runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ..artifact_checks import check_tokenizer_config
from ..contract import ContractError
from ..declared import MISSING
from ..files import MAX_JSON_BYTES, FileRefused, read_regular
from ..values import short
from .checks import one_line
from .errors import ExportError
from .lazy_weights import LazyWeights, SafetensorsWeights

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class Checkpoint:
    source: str
    config: object  # a transformers PretrainedConfig
    weights: LazyWeights  # name -> torch.Tensor, read from the files as taken
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    # what the artifact keeps of the tokenizer's tokenizer_config.json (chat template, BOS/EOS, add_bos_token);
    # None when the checkpoint has none
    tokenizer_config: dict | None = None

    @property
    def parameters(self) -> int:
        """Parameter count, from the files without reading a tensor (a tied head is stored once)."""
        return self.weights.parameter_count()


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load config, weights and tokenizer from a HF model dir, a .gguf file or a hub id."""
    local = Path(path)
    if local.is_file() and local.suffix == ".gguf":
        return _load_gguf(local)
    if local.is_dir():
        return _load_dir(local)
    if local.exists():
        raise ExportError(f"{path}: expected a model directory or a .gguf file")
    if str(path).count("/") == 1 and not str(path).startswith((".", "/")):
        return _load_dir(_download(str(path)))
    raise ExportError(f"{path}: no such file or directory")


def load_tokenizer_and_config(path: str | Path, tokenizer: bool = True):
    """The tokenizer and config of a checkpoint, without its weights (for checks before export); the tokenizer
    is None when not asked for (building a GGUF file's takes seconds). The config is checked as ``load_checkpoint``
    checks it: its settings by its family's rules, its sizes against the shapes its files hold."""
    local = Path(path)
    if local.is_file() and local.suffix == ".gguf":
        check_gguf_header(local)
        config, built, _, _, _ = _read_gguf(local, tokenizer)
        return built, config
    directory = local if local.is_dir() else None
    if directory is None:
        if local.exists():
            raise ExportError(f"{path}: expected a model directory or a .gguf file")
        if str(path).count("/") != 1 or str(path).startswith((".", "/")):
            raise ExportError(f"{path}: no such file or directory")
        directory = _download(str(path))
    return (_read_tokenizer(directory) if tokenizer else None), _read_config(directory)


def _read_config(directory: Path, weights: LazyWeights | None = None):
    """The checkpoint's config, checked (``checks``) as declared, as transformers built it, and against the shapes of
    ``weights`` (the folder's, read from the files' headers where not given) before anything is sized by it."""
    from transformers import AutoConfig

    from .checks import check_config, check_declared, check_weights, unread_dropped

    path = directory / "config.json"
    if not path.is_file():
        raise ExportError(f"{directory}: missing config.json; expected a Hugging Face model directory")
    if weights is None:
        weights = _read_safetensors(_shards(directory))
    declared = _json_object(path)
    arch = _architecture(declared.get("model_type", MISSING), path)
    check_declared(declared, arch, str(path), tensors=len(weights))
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except RecursionError as exc:
        raise ExportError(f"{path}: nested too deeply to be a model config") from exc
    except Exception as exc:  # transformers refuses it (its strict fields, its own checks): so do we, in one line
        raise ExportError(f"{path}: cannot be read ({type(exc).__name__}: {one_line(exc)})") from exc
    unread_dropped(config, arch)
    check_config(config, arch, str(path), declared)
    check_weights(arch, config, weights.shapes, str(path), declared)
    return config


def _json_object(path: Path, what: str = "a model config") -> dict:
    """A JSON object read from ``path`` (a regular file of at most MAX_JSON_BYTES); ExportError in one line otherwise."""
    try:
        data = json.loads(read_regular(path, MAX_JSON_BYTES).decode("utf-8"))
    except FileRefused as exc:
        raise ExportError(str(exc)) from exc
    except RecursionError as exc:
        raise ExportError(f"{path}: nested too deeply to be {what}") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ExportError(f"{path}: cannot be read ({type(exc).__name__}: {one_line(exc)}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _architecture(model_type, where: Path):
    """The registered architecture of a declared ``model_type``: refused before transformers reads anything else."""
    from .registry import ARCHITECTURES, architecture_of

    if not isinstance(model_type, str):
        raise ExportError(f"{where}: model_type: got {short(model_type)}; expected one of "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    try:
        return architecture_of(model_type)
    except ExportError as exc:
        raise ExportError(f"{where}: {exc}") from None


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:  # network, auth, unknown repo: one clear message
        raise ExportError(f"{repo_id}: not a local path, and fetching it from the hub failed ({exc})") from exc


def _load_dir(directory: Path) -> Checkpoint:
    if not (directory / "config.json").is_file():
        raise ExportError(f"{directory}: missing config.json; expected a Hugging Face model directory")
    weights = _read_safetensors(_shards(directory))
    config = _read_config(directory, weights)
    return Checkpoint(str(directory), config, weights, _read_tokenizer(directory), _eos_ids(directory, config),
                      _read_tokenizer_config(directory))


def _shards(directory: Path) -> list[Path]:
    """The folder's ``*.safetensors`` files; pickled weights are refused unread."""
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ExportError(
                f"{directory}: only pickled weights ({', '.join(pickled)}); refusing to unpickle them, since loading "
                "a pickle runs arbitrary code. Convert the checkpoint to safetensors on a trusted machine first"
            )
        raise ExportError(f"{directory}: no *.safetensors weights found")
    return shards


def _read_safetensors(shards: list[Path]) -> SafetensorsWeights:
    """The shards' tensors, each read (memory-mapped) when the exporter takes it: the fused form then holds one
    layer of a checkpoint at a time, however large it is."""
    from safetensors import SafetensorError

    for path in shards:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            header = int.from_bytes(handle.read(8), "little")
        if size < 8 or header > size - 8:  # checked here so that no reader sizes a buffer from it
            raise ExportError(f"{path}: corrupt or unreadable safetensors file (header of {header} bytes in a "
                              f"{size}-byte file)")
    try:
        return SafetensorsWeights(shards)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ExportError(f"{shards[0].parent}: corrupt or unreadable safetensors file ({exc})") from exc


def _read_tokenizer(directory: Path) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{directory}: missing tokenizer.json (a fast tokenizer is required)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ExportError(f"{path}: cannot be read as a tokenizer ({exc})") from exc


TOKENIZER_CONFIG_KEYS = ("chat_template", "bos_token", "eos_token", "add_bos_token")


def _read_tokenizer_config(directory: Path) -> dict | None:
    """The chat template, BOS/EOS tokens and ``add_bos_token`` of a HF dir's tokenizer_config.json."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    data = _json_object(path, "a tokenizer config")
    return tokenizer_config(data.get("chat_template"), data.get("bos_token"), data.get("eos_token"),
                            data.get("add_bos_token", False), path)


def tokenizer_config(template, bos, eos, add_bos, where) -> dict:
    """The artifact's tokenizer_config.json: what transformers' ``apply_chat_template`` and BOS handling read."""
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    tokens = {}
    for name, token in (("bos_token", bos), ("eos_token", eos)):
        token = token.get("content") if isinstance(token, dict) else token  # AddedToken, serialised
        if token is not None and not isinstance(token, str):
            raise ExportError(f"{where}: {name} must be a string, got {type(token).__name__}")
        tokens[name] = token
    if template is not None and not isinstance(template, str):
        raise ExportError(f"{where}: chat_template must be a string, got {type(template).__name__}")
    if add_bos is not None and not isinstance(add_bos, bool):  # "false" would be taken as true
        raise ExportError(f"{where}: add_bos_token: got {add_bos!r} ({type(add_bos).__name__}); expected true or false")
    config = {"chat_template": template, **tokens, "add_bos_token": bool(add_bos)}
    try:
        check_tokenizer_config(config, str(where))  # the template compiles, as the artifact's loader will ask
    except ContractError as exc:
        raise ExportError(str(exc)) from None
    return config


def _eos_ids(directory: Path | None, config) -> tuple[int, ...]:
    ids = []
    sources = [getattr(config, "eos_token_id", None)]
    gen = directory / "generation_config.json" if directory else None
    if gen and gen.is_file():
        generation = _json_object(gen, "a generation config")
        sources.append(generation.get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


GGUF_MAGIC = b"GGUF"
GGUF_MAX_COUNT = 1 << 20  # tensors or metadata entries: real models have hundreds


def check_gguf_header(path: Path) -> None:
    """Refuse a GGUF file whose header is not GGUF or declares absurd counts, before any parser allocates."""
    with open(path, "rb") as handle:
        header = handle.read(24)
    if len(header) < 24 or header[:4] != GGUF_MAGIC:
        raise ExportError(f"{path}: not a GGUF file (magic {header[:4]!r}, expected {GGUF_MAGIC!r})")
    version = int.from_bytes(header[4:8], "little")
    tensors, entries = int.from_bytes(header[8:16], "little"), int.from_bytes(header[16:24], "little")
    if version not in (2, 3):
        raise ExportError(f"{path}: GGUF version {version} is not supported; expected 2 or 3")
    if tensors > GGUF_MAX_COUNT or entries > GGUF_MAX_COUNT:
        raise ExportError(f"{path}: GGUF header declares {tensors} tensors and {entries} metadata entries; "
                          f"refusing counts above {GGUF_MAX_COUNT}")


def gguf_vocabulary_digest(path: str | Path) -> str | None:
    """sha256 of a GGUF file's tokenizer metadata (``tokenizer.ggml.*``) and declared vocab size, or None
    where ``path`` is not a readable GGUF file. Two files with the same digest give transformers the same
    tokenizer and vocabulary: a pair check that needs a few seconds of header parsing, not ~20 s per file
    of building both tokenizers. The chat template is left out: it does not change a token id."""
    from .gguf_weights import reader_class

    path = Path(path)
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    try:
        check_gguf_header(path)
        reader = reader_class()(str(path))
    except Exception:  # ExportError, or whatever gguf-py raises on a malformed file
        return None  # the full check reports it, in one line
    digest = hashlib.sha256()
    for key in sorted(reader.fields):
        if key.startswith("tokenizer.ggml.") or key.endswith(".vocab_size"):
            field = reader.fields[key]
            digest.update(f"{key}\0{[int(t) for t in field.types]}\0".encode())
            for index in field.data:  # each value with its length: ["ab", "c"] and ["a", "bc"] differ
                value = field.parts[index].tobytes()
                digest.update(len(value).to_bytes(8, "little") + value)
    return digest.hexdigest()


def _load_gguf(path: Path) -> Checkpoint:
    """A GGUF file's config and tokenizer (``_read_gguf``); its weights dequantized one tensor at a time as the
    exporter takes them (``GgufWeights``), never the whole fp32 model at once."""
    from .gguf_weights import GgufWeights

    check_gguf_header(path)
    model_config, tokenizer, config, eos, reader = _read_gguf(path)
    with _one_line(path, "cannot be loaded as GGUF"):  # gguf-py's and transformers' errors on a file they cannot map
        weights = GgufWeights(path, model_config, reader)
    eos = _eos_ids(None, model_config) or tuple(t for t in [eos] if isinstance(t, int))
    return Checkpoint(str(path), model_config, weights, tokenizer, eos, config)


@contextmanager
def _one_line(path: Path, what: str):
    """Whatever a library raises inside, as one ExportError naming ``path`` and ``what`` failed (ours pass as raised)."""
    try:
        yield
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"{path}: {what} ({type(exc).__name__}: {one_line(exc)})") from exc


def _read_gguf(path: Path, tokenizer: bool = True):
    """(config, tokenizers.Tokenizer or None, the artifact's tokenizer_config or None, the tokenizer's EOS id or None,
    the file's parsed metadata) of a GGUF file. Its metadata is checked before any config is built from it: each value
    by its family's rules (``checks``; named by its key in the file), and its block count against the blocks its
    tensors hold. The config comes from transformers' GGUF support, or for the architectures transformers cannot load
    from GGUF and we read ourselves (``gguf_config.GGUF_FAMILIES``), from the metadata; it is checked once more as
    built. Whatever gguf-py, transformers or the tokenizer converter raise on a malformed file is one line naming it."""
    from transformers import AutoConfig, AutoTokenizer

    from . import gguf_config
    from .checks import check_config, check_declared, unread_dropped
    from .gguf_weights import fast_gguf_parsing, reader_class

    with _one_line(path, "cannot be loaded as GGUF"):  # a truncated file, absurd array lengths: IndexError, ...
        reader = reader_class()(str(path))
        model_type, declared, names = gguf_config.declared(reader)
    arch = _architecture(model_type, path)
    check_declared(declared, arch, str(path), names, tensors=len(reader.tensors))
    gguf_config.check_blocks(reader, path)
    ours = gguf_config.claims(reader)  # read by us (a llama only where it has experts: Mixtral), not by transformers
    with _one_line(path, "cannot be loaded as GGUF"):
        if ours:
            model_config = gguf_config.read_config(reader)
        else:
            with fast_gguf_parsing():
                model_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    unread_dropped(model_config, arch)
    check_config(model_config, arch, str(path), declared, names)
    if not tokenizer:
        return model_config, None, None, None, reader
    with _one_line(path, "its tokenizer cannot be built"):
        if ours:
            built, settings = gguf_config.read_tokenizer(path)
            eos = built.token_to_id(settings["eos_token"]) if settings.get("eos_token") else None
            config = tokenizer_config(settings.get("chat_template"), settings.get("bos_token"),
                                      settings.get("eos_token"), settings.get("add_bos_token", False), path)
            return model_config, built, config, eos, reader
        with fast_gguf_parsing():
            built = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = tokenizer_config(getattr(built, "chat_template", None), built.bos_token, built.eos_token,
                              getattr(built, "add_bos_token", False), path)
    return model_config, built.backend_tokenizer, config, getattr(built, "eos_token_id", None), reader
