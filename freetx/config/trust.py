"""What a config may name, and how a user trusts more (docs/trust.md).

A config, a checkpoint or a data file someone sent is data. A config names code by its
`_component_` nodes, and freetx builds only what this allowlist holds (`check_component`):

- freetx's own components: the classes and the model builders (`BuildsConfig`) of
  `freetx.data`, `freetx.models`, `freetx.objectives`, `freetx.loggers`, `freetx.envs`;
- `torch.optim` (optimizers and lr schedulers), `torch.nn` (modules, init);
- torchao's optimizers (`torchao.optim`) and quantization configs (`torchao.quantization`).

The dotted path as written and the home of every object on the way must lie there, so
`freetx.data.tokenizers.os.system` is `os`'s, and refused. Anything else (the user's own
reward module, a helper beside the config, another package) runs only when the user says
so for this command: `--trust NAME` (a module or a dotted name) or the environment
variable FREETX_TRUST=NAME,NAME (never a config key: a config cannot trust itself). The
same word `--trust` allows the config's other doors: `remote_code` for a
`trust_remote_code: true`, `env:NAME` for a `${oc.env:NAME}` interpolation (FREETX_* and
SLURM_* are allowed without it), and a task folder's path for lm-eval YAMLs that run
Python (`!function`).
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from freetx.errors import ConfigError

# where a config's components may come from without --trust: module prefixes
ALLOWED_MODULES = (
    "freetx.data", "freetx.models", "freetx.objectives", "freetx.loggers", "freetx.envs",
    "torch.optim", "torch.nn", "torchao.optim", "torchao.quantization",
)  # fmt: skip
# of those, freetx's: only classes and model builders (a plain function of freetx, such as
# one that writes a file it is given, is no component)
FREETX = "freetx"
TRUST_ENV = "FREETX_TRUST"
OLD_TRUST_ENV = "FREETX_ALLOW_COMPONENTS"  # the name before `--trust`: still read
REMOTE_CODE = "remote_code"
ENV_PREFIX = "env:"
ALLOWED_ENV = ("FREETX_", "SLURM_")  # ${oc.env:NAME} of these needs no --trust
DOCS = "docs/trust.md"


def trusted() -> list[str]:
    """What the user trusts for this command: `--trust` and FREETX_TRUST, comma-separated."""
    names = f"{os.environ.get(TRUST_ENV, '')},{os.environ.get(OLD_TRUST_ENV, '')}"
    return [n.strip() for n in names.split(",") if n.strip()]


def add_trusted(names: Iterable[str]) -> None:
    """Trust `names` for this command: its ranks and children inherit the environment."""
    every = [*trusted(), *(n.strip() for name in names for n in name.split(",") if n.strip())]
    os.environ[TRUST_ENV] = ",".join(dict.fromkeys(every))
    os.environ.pop(OLD_TRUST_ENV, None)


def within(name: str, prefixes: Iterable[str]) -> str | None:
    """The first of `prefixes` that `name` is or lies under (`os` for `os.path.join`)."""
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


def place(obj: Any) -> str | None:
    """Where an object lives: a module's name, else `module.qualname` (None: unknown)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else None


def _is_freetx_component(obj: Any) -> bool:
    from freetx.fields import BuildsConfig

    return isinstance(obj, type) or isinstance(obj, BuildsConfig)


def check_component(dotted: str, where: str, places: list[str], target: Any = None) -> None:
    """Refuse a component outside the allowlist (by the path as written and the home of
    each object on the way: `places`) unless the user trusts it for this command; `target`:
    the object imported (None: only the path is known yet). A name the user trusts as
    written is trusted wherever it lives; one under a trusted module (`my_rewards.f`) only
    where the module's own code is (`my_rewards.os.system` is `os`'s)."""
    trust = trusted()
    if dotted in trust:
        return
    for name in [dotted, *places]:
        if within(name, trust):
            continue
        allowed = within(name, ALLOWED_MODULES)
        if allowed and (
            target is None or not allowed.startswith(FREETX) or _is_freetx_component(target)
        ):
            continue
        raise ConfigError(_refusal(dotted, name, where))


def _refusal(dotted: str, name: str, where: str) -> str:
    which = f" (which is {name})" if not dotted.startswith(name) else ""
    module = name.split(".")[0] if not name.startswith(FREETX) else name
    return (
        f"{where}: '{dotted}'{which} is refused: a config is data, and freetx builds from it "
        "only freetx's datasets, models, objectives and loggers, torch.optim, torch.nn and "
        "torchao's optimizers and quantization configs; other "
        "code (your reward module, another package) runs only when you say so for the "
        f"command. If it is your own code and you mean it: freetx run --trust {module} ... "
        f"(or {TRUST_ENV}={module}); never trust what a config you were sent names without "
        f"reading it ({DOCS})."
    )


# -- the config's other doors: environment variables, remote code -------------------------

_ENV_INTERPOLATION = re.compile(r"\$\{\s*oc\.env\s*:\s*([^,}]*)")


def env_allowed(name: str) -> bool:
    """Whether a config may read the environment variable `name` (`${oc.env:NAME}`)."""
    trust = trusted()
    return (
        name.startswith(ALLOWED_ENV) or f"{ENV_PREFIX}{name}" in trust or f"{ENV_PREFIX}*" in trust
    )


def _env_refusal(where: str | None, name: str) -> str:
    plainly = f"on the command line ({where}=VALUE)" if where else "as a plain value"
    return (
        f"{where or 'the config'}: ${{oc.env:{name}}} copies the environment variable {name} into the config, "
        "and from there into folder names, config.yaml and every checkpoint; a config you "
        "were sent could copy a secret that way. Only FREETX_* and SLURM_* variables are "
        f"read without your say-so: give the value {plainly}, or "
        f"allow it: freetx run --trust {ENV_PREFIX}{name} ... ({DOCS})."
    )


def check_config_doors(cfg: DictConfig | ListConfig, path: str = "") -> None:
    """Refuse, before anything is resolved or built, a config that reads an environment
    variable (`${oc.env:NAME}`) or asks for a model's own code (`trust_remote_code: true`)
    without the user's `--trust`."""
    keys = list(cfg.keys()) if isinstance(cfg, DictConfig) else range(len(cfg))
    for key in keys:
        if isinstance(cfg, ListConfig):
            where = f"{path}[{key}]"
        else:
            where = f"{path}.{key}" if path else str(key)
        node = cfg._get_node(key)
        if isinstance(node, (DictConfig, ListConfig)):
            check_config_doors(node, where)
            continue
        raw = node._value() if node is not None else None
        if isinstance(raw, str):
            for name in _ENV_INTERPOLATION.findall(raw):
                if not env_allowed(name.strip()):
                    raise ConfigError(_env_refusal(where, name.strip()))
        if str(key) == "trust_remote_code" and raw not in (False, None, "false", "False"):
            if REMOTE_CODE not in trusted():
                raise ConfigError(
                    f"{where}: trust_remote_code runs the Python files of a model folder (with "
                    "a hub name and a network, of a repository), and a config is data. Remove "
                    "the key; or, if you have read that code and mean it, allow it for this "
                    f"command: freetx run --trust {REMOTE_CODE} ... ({DOCS})."
                )


_UNSET = object()


def _checked_env(name: str, default: Any = _UNSET) -> Any:
    """OmegaConf's `oc.env` resolver, asking `env_allowed` first (the backstop of
    `check_config_doors` for a config resolved without it)."""
    if not env_allowed(str(name)):
        raise ConfigError(_env_refusal(None, str(name)))
    if str(name) in os.environ:
        return os.environ[str(name)]
    if default is not _UNSET:
        return default
    raise ConfigError(f"the environment variable {name} is not set (${{oc.env:{name}}}).")


OmegaConf.register_resolver("oc.env", _checked_env, replace=True, annotation_validation="off")


# -- lm-eval task folders ------------------------------------------------------------------

_FUNCTION_TAG = re.compile(r"!function\s+([\w.]+)")


def check_task_folder(folder: str | Path, key: str = "include_path") -> None:
    """An lm-eval task folder whose YAMLs say `!function module.name` runs that module's
    Python (lm-eval imports `module.py` beside the YAML): refused unless the user trusts the
    folder (`--trust FOLDER`); a `!function` naming no file there is refused outright."""
    root = Path(folder).expanduser().resolve()
    trust = {Path(t).expanduser().resolve() for t in trusted() if not t.startswith(ENV_PREFIX)}
    for yaml_file in sorted(root.rglob("*.y*ml")):
        try:
            text = yaml_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for target in _FUNCTION_TAG.findall(text):
            module = target.rsplit(".", 1)[0]
            source = yaml_file.parent / f"{module.replace('.', '/')}.py"
            if not source.is_file():
                raise ConfigError(
                    f"{key}={folder}: {yaml_file.name} says `!function {target}`, and lm-eval "
                    f"would import {source.name} beside it, which is not there; a task's "
                    "functions live in a Python file of the task folder. Add the file or "
                    "remove the line."
                )
            if not any(t == root or t in yaml_file.parents for t in trust):
                raise ConfigError(
                    f"{key}={folder}: {yaml_file.name} says `!function {target}`, so lm-eval "
                    f"runs the Python of {source} when it reads the task: a task folder with "
                    "functions is code, not data. If you have read it and mean it, trust the "
                    f"folder for this command: --trust {folder} ({DOCS})."
                )
