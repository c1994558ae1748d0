"""Hugging Face hub names, told apart from local paths: a model or tokenizer may be given as either."""
from pathlib import Path


def is_hub_name(name: str | Path) -> bool:
    """Whether `name` has the form of a hub name (gpt2-large, openai-community/gpt2), not that of a path
    (runs/quick/oracle, /models/x)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(name))
    except HFValidationError:
        return False
    return True
