"""Saved models, by directory or hub name, read with a one-line error: a missing, truncated or garbage checkpoint says which and
what to do, instead of a traceback from deep inside transformers or safetensors."""
from pathlib import Path

from decode.errors import InputError, first_line
from decode.hub import is_hub_name

RETRAIN = "pass a directory written by save_pretrained, or train it again if its files are damaged"
# GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as transformers computes it in one torch kernel;
# its "gelu_new" is the same function in eight elementwise ops over the MLP's activations, each a pass over memory.
FUSED_GELU = "gelu_pytorch_tanh"


def load_causal_lm(name_or_dir, role: str, hint: str = RETRAIN, **kwargs):
    """AutoModelForCausalLM.from_pretrained(name_or_dir, **kwargs), a GPT-2-style "gelu_new" computed as
    FUSED_GELU; `role` names it in the error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = model_dir(name_or_dir, role)  # a hub name: its files in the hub's cache
    if not directory.exists():
        raise InputError(f"the {role} {name_or_dir} does not exist, and it is no hub name; {hint}")
    try:
        config = AutoConfig.from_pretrained(str(directory))
        if getattr(config, "activation_function", None) == "gelu_new":
            config.activation_function = FUSED_GELU
        return AutoModelForCausalLM.from_pretrained(str(directory), config=config, **kwargs)
    except Exception as err:  # file, JSON and safetensors errors of many kinds
        raise InputError(f"cannot load the {role} from {name_or_dir} ({first_line(err)}); {hint}") from None


def load_safetensors(model_dir) -> dict:
    """Every tensor of the *.safetensors files in a save_pretrained directory, each mapped from its file on its own:
    a tensor dropped (as the C++ forward drops each matrix it has packed) takes its pages with it, where one mapping
    of the whole file would keep every page read through it resident, a second copy of the weights."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputError(f"no .safetensors weights in {model_dir}; save the model with save_pretrained")
    weights = {}
    for f in files:
        try:
            with safe_open(f, "pt") as handle:
                names = list(handle.keys())
            for name in names:
                with safe_open(f, "pt") as handle:
                    weights[name] = handle.get_tensor(name)
        except Exception as err:  # SafetensorError, OSError
            raise InputError(f"cannot read the weights {f} ({first_line(err)}); {RETRAIN}") from None
    return weights


def model_dir(model: str | Path, name: str) -> Path:
    """A model's directory: a local directory as it is, or a hub name's files (config, tokenizer, safetensors) from
    huggingface_hub's cache, downloaded first when online. A local path that does not exist is returned as it is, for
    the caller's own message."""
    from huggingface_hub import constants, snapshot_download

    if Path(model).is_dir() or not is_hub_name(model):
        return Path(model)

    try:
        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as err:  # not found, offline, no access: many kinds
        offline = "HF_HUB_OFFLINE is set; " if constants.HF_HUB_OFFLINE else ""
        skip = "" if constants.HF_HUB_OFFLINE else "; offline, HF_HUB_OFFLINE=1 skips the network"
        raise InputError(f"{name} {model} is not a directory, and the hub name is not in the local cache and could not "
                         f"be downloaded ({offline}{first_line(err)}); download it first (hf download "
                         f"{model}) or pass a local directory{skip}") from None
