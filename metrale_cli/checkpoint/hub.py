"""Hub ids ("owner/name") resolved to a local snapshot with ``huggingface_hub``.

Only what metrale reads is fetched: configs, tokenizer files, chat templates, safetensors.
With no network (or ``HF_HUB_OFFLINE=1``) a model not in the cache fails at once, in one line.
"""

from __future__ import annotations

import pathlib
import re

from metrale_cli.errors import MetraleError

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def is_hub_id(spec: str) -> bool:
    """True for "owner/name" strings, with an optional "@revision" (a branch, tag or commit; no
    path of that name needs to exist)."""
    return bool(_HUB_ID.match(spec)) and ".." not in spec and not spec.split("@")[0].endswith(".gguf")


def snapshot(spec: str) -> pathlib.Path:
    """Local folder holding the config, tokenizer and safetensors files of ``spec``
    ("owner/name" or "owner/name@revision")."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    repo_id, _, revision = spec.partition("@")
    try:
        return pathlib.Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=ALLOW_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise MetraleError(f"model {spec!r} not found on the Hugging Face hub "
                           f"({type(exc).__name__})",
                           "check the id, or log in with `hf auth login` for gated models") from None
    except Exception as exc:  # offline, DNS, timeouts, HTTP errors: all mean "can't get it now"
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            reason = f"HF_HUB_OFFLINE is set and it is not in the cache folder {cache}"
        else:
            reason = f"the hub is unreachable (HF_HUB_OFFLINE unset) and it is not in the cache folder {cache}"
        raise MetraleError(f"cannot load {spec!r}: {reason} ({type(exc).__name__})",
                           "download it on a machine with network into that cache (or set "
                           "HF_HOME/HF_HUB_CACHE), or pass a local folder / .gguf file") from None
