"""`--model org/name`: a Hugging Face repo id resolved to a local snapshot directory.

One resolver for every command: `pdserve.cli.main` calls `resolve_model` once,
before a command runs, so the rest of the program only ever sees a directory
(and `pdserve up` hands its children that directory, never the id). A value
that is an existing directory, or does not look like `org/name`, is returned
unchanged; only the files the engine and the gateway read are downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pdserve.common import envs

# What the engine (weights, config) and the gateway (tokenizer, chat template,
# generation defaults) read; nothing else of a repo (other weight formats,
# ONNX/GGUF exports, README images) is fetched.
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "adapter_config.json",  # a PEFT LoRA adapter (`--lora-modules name=org/adapter`)
)

# `org/name` as the Hub spells ids: letters, digits, `-`, `_`, `.`; no `..`.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class HubError(ValueError):
    """A repo id that cannot be resolved; the message is one line."""


@dataclass(frozen=True)
class HubSource:
    """Where a repo id is fetched from: revision, cache directory, token, offline mode."""

    revision: str | None = None
    download_dir: Path | None = None

    @property
    def cache_dir(self) -> Path:
        return self.download_dir if self.download_dir is not None else envs.hf_cache_dir()


def is_repo_id(model: str) -> bool:
    """`model` looks like `org/name` and is not a path that exists here."""
    return bool(_REPO_ID.match(model)) and ".." not in model and not Path(model).exists()


def resolve_model(model: str, source: HubSource) -> str:
    """The local directory for `model`: itself unless it is a repo id, else the
    snapshot directory in the Hugging Face cache (downloaded unless offline)."""
    if not is_repo_id(model):
        return model
    import huggingface_hub
    from huggingface_hub import errors

    offline = envs.hf_offline()
    where = f"{model}" + (f" at revision {source.revision}" if source.revision else "")
    try:
        path = huggingface_hub.snapshot_download(
            model,
            revision=source.revision,
            cache_dir=str(source.cache_dir),
            token=envs.hf_token(),
            local_files_only=offline,
            allow_patterns=list(ALLOW_PATTERNS),
        )
    except errors.GatedRepoError:
        raise HubError(f"{where} is gated: accept its terms on huggingface.co and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"no Hugging Face repo {model!r} (or it is private: set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{model!r} has no revision {source.revision!r}") from None
    except errors.LocalEntryNotFoundError:
        if offline:
            raise HubError(
                f"{where} is not in the Hugging Face cache {source.cache_dir} and HF_HUB_OFFLINE is set"
            ) from None
        raise HubError(f"{where} could not be downloaded and is not in {source.cache_dir}") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise HubError(f"downloading {where} failed: {e}") from None
    return str(Path(str(path)))
