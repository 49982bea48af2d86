"""What ``kernelattn convert``'s encoder path (:mod:`~kernelattn_core.cli.convert_cmd`) and its
decoder path (:mod:`~kernelattn_core.cli.convert_decoder`) share: the encoder-only options,
the texts, output paths and one-line messages (a module of its own, so the two paths import
it and not each other)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import InputError

#: options of the sentence-embedding (encoder) report that a decoder refuses
ENCODER_ONLY = (
    "--sentences",
    "--passages",
    "--allocate",
    "--allocate-windows",
    "--allocate-heavy",
    "--allocate-steps",
    "--e2e-weight",
    "--e2e-length",
    "--e2e-batch",
)

_SPECIAL_TEXTS = ("shipped", "held-out", "fitting", "legal", "narrative")


def _share(share: float) -> str:
    """A share for a warning: never "0%" for a positive share (a few boilerplate sentences
    of a long text round to 0% at two digits)."""
    return f"{share:.1%}" if share >= 1e-3 else "under 0.1%"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _check_output_path(flag: str, path: str | None) -> None:
    """A file that can be written: not a folder, in a folder that exists and is writable
    (checked before any work, not after the whole fit; the convert writers create no folder)."""
    from ..report.output import check_output_path

    check_output_path(flag, path, make_folders=False)


def _read_texts(flag: str, source: str) -> str:
    """The text of ``--fit-texts`` / ``--eval-texts``: a special name, or a UTF-8 file
    with some text in it."""
    from ..workloads import minilm

    if source in _SPECIAL_TEXTS:
        return minilm.read_texts(source)
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{flag}: expected a readable text file or one of {list(_SPECIAL_TEXTS)}, got {source!r}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{flag}: {source!r} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
            "convert it to UTF-8"
        ) from None
    except OSError as exc:
        raise InputError(f"{flag}: cannot read {source!r}: {_one_line(exc)}") from None
    if not text.strip():
        raise InputError(f"{flag}: {source!r} holds no text")
    return text


def _stage(note: str, enabled: bool) -> None:
    """A stage of the conversion announced on stderr (when ``enabled``)."""
    if enabled:
        sys.stderr.write(note + "\n")
        sys.stderr.flush()
