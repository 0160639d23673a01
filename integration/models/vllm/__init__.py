"""vLLM plugin: PLE tables served from uvaple host tables (Qwen4Exp n-gram PLE, Gemma 3n).

Entry point ``vllm.general_plugins: uvaple = uvaple.integration.models.vllm:register``. vLLM calls
:func:`register` in every process it starts (API server, engine core, each worker); it is re-entrant.

* Version guard: supported vLLM versions are :data:`SUPPORTED_VLLM`. On any other version the plugin
  logs why and registers nothing: vLLM runs as if it were not installed, never half-patched.
* Registration: the plugin's model classes are registered for the architectures in :data:`MODELS`, as
  lazy ``module:class`` strings (nothing is imported until vLLM builds such a model). Each is a subclass
  of vLLM's own class and builds exactly vLLM's model unless the plugin is enabled for that engine.
* Enabling: ``--additional-config '{"uvaple": {...}}'`` and/or ``UVAPLE_*`` environment variables
  (:mod:`uvaple.integration.models.vllm.config`); settings are checked when the plugin loads (the environment),
  when vLLM builds the engine's config for a model the plugin serves (both: in ``vllm serve``'s API server
  process, seconds into its start, before the engine core is started; in the process of an offline ``LLM()``)
  and again when the model is built. A bad one is a named :class:`PluginConfigError` (raised inside vLLM's
  config, pydantic reports it as a ``ValidationError`` of ``VllmConfig`` that carries the plugin's message). A
  ``"uvaple"`` entry for a model the plugin does not serve is never read: :func:`check_model` says so (a
  warning, once per process).
* The config check: vLLM runs a per-architecture check when it builds its config
  (``vllm.model_executor.models.config.MODELS_CONFIG_MAP``, called from ``VllmConfig.__post_init__``);
  :func:`register` puts, for each architecture in :data:`MODELS`, a subclass of vLLM's own entry there (or of
  its no-op base, where vLLM has none) that runs vLLM's check first, then the plugin's settings check. It
  changes no setting; where vLLM has no such map, the check at model build stays the first.
* What changes when enabled: :mod:`~uvaple.integration.models.vllm.qwen4_exp`,
  :mod:`~uvaple.integration.models.vllm.gemma3n`; sharing and loading: :mod:`~uvaple.integration.models.vllm.tables`.

Importing this module imports nothing from vLLM and changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from .config import ENV_VARS, PluginConfig, PluginConfigError, from_sources

__all__ = ["register", "SUPPORTED_VLLM", "MODELS", "PluginConfig", "PluginConfigError", "ENV_VARS",
           "supported", "check_model"]

log = logging.getLogger("uvaple.vllm")

#: vLLM release series the plugin is built and tested against (``major.minor``)
SUPPORTED_VLLM = ("0.33",)

#: architecture -> the plugin's class (lazy ``module:class``)
MODELS = {arch: f"{__name__}.{module}:Uvaple{arch}" for arch, module in (
    ("Qwen4ExpForCausalLM", "qwen4_exp"), ("Qwen4ExpForConditionalGeneration", "qwen4_exp"),
    ("Gemma3nForCausalLM", "gemma3n"), ("Gemma3nForConditionalGeneration", "gemma3n"))}

_lock = threading.Lock()
_registered = False
_warned_unserved = False


def supported(version: str) -> bool:
    """Whether vLLM ``version`` (e.g. ``"0.33.0"``, ``"0.33.1.dev4+g..."``) is in :data:`SUPPORTED_VLLM`."""
    parts = str(version).split(".")
    return len(parts) >= 2 and ".".join(parts[:2]) in SUPPORTED_VLLM


def register() -> bool:
    """vLLM's plugin hook: register the plugin's model classes. Returns whether they are registered.

    Re-entrant and idempotent. An unsupported vLLM version is logged and leaves vLLM untouched; a bad
    ``UVAPLE_*`` environment variable raises :class:`PluginConfigError` (the server must not start with a
    setting it would ignore).
    """
    global _registered
    with _lock:
        if _registered:
            return True
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        if not supported(version):
            log.warning("uvaple: vLLM %s is not supported (supported: %s); the uvaple plugin stays inert and "
                        "vLLM serves its own PLE tables", version, ", ".join(f"{v}.x" for v in SUPPORTED_VLLM))
            return False
        from_sources(None, os.environ)  # a bad environment variable fails now, in every process
        from vllm import ModelRegistry

        for arch, target in MODELS.items():
            ModelRegistry.register_model(arch, target)
        _check_settings_with_the_config()
        _registered = True
        return True


def _check_settings_with_the_config() -> None:
    """vLLM's per-architecture config check of each architecture in :data:`MODELS` made to run the plugin's
    settings check after its own (see the module docstring); already so: left as it is."""
    try:
        from vllm.model_executor.models import config as model_configs

        table, default = model_configs.MODELS_CONFIG_MAP, model_configs.VerifyAndUpdateConfig
    except (ImportError, AttributeError) as e:
        log.info("uvaple: vLLM has no per-architecture config check here (%s); the plugin's settings are checked "
                 "when the model is built", e)
        return
    for arch in MODELS:
        base = table.get(arch, default)
        if not getattr(base, "_uvaple_checks_settings", False):
            table[arch] = _with_settings_check(base)


def _with_settings_check(base: type) -> type:
    """A subclass of vLLM's config check ``base`` whose ``verify_and_update_config`` runs ``base``'s, then
    :func:`~uvaple.integration.models.vllm.config.from_sources` on the engine's additional config."""

    def verify_and_update_config(vllm_config) -> None:
        base.verify_and_update_config(vllm_config)
        additional = getattr(vllm_config, "additional_config", None)
        from_sources(additional if isinstance(additional, Mapping) else None, os.environ)

    return type(f"Uvaple{base.__name__}", (base,), {
        "__doc__": f"vLLM's {base.__name__}, then the uvaple plugin's settings check.",
        "__module__": __name__, "_uvaple_checks_settings": True,
        "verify_and_update_config": staticmethod(verify_and_update_config)})


def check_model(vllm_config) -> bool:
    """Whether the plugin serves the model of ``vllm_config`` (a ``VllmConfig``: its ``model_config``'s
    architectures against :data:`MODELS`).

    Where it does not and the engine's ``additional_config`` has a ``"uvaple"`` entry, the entry is never
    read (vLLM builds its own model class): a warning says so, naming the key, the model and what the plugin
    serves, once per process. Call it where the engine's config is in hand; it reads attributes only (no
    vLLM import), so a stand-in config tests it.
    """
    global _warned_unserved
    mc = getattr(vllm_config, "model_config", None)
    archs = list(getattr(mc, "architectures", None) or getattr(getattr(mc, "hf_config", None), "architectures", None)
                 or [])
    if any(a in MODELS for a in archs):
        return True
    additional = getattr(vllm_config, "additional_config", None) or {}
    if "uvaple" not in additional:
        return False
    with _lock:
        if _warned_unserved:
            return False
        _warned_unserved = True
    log.warning('uvaple: --additional-config has a "uvaple" entry, but the model %s (architectures %s) is not one '
                "the uvaple plugin serves (%s): the entry is ignored and vLLM serves the model as it is",
                getattr(mc, "model", "?"), archs or "unknown", ", ".join(MODELS))
    return False
