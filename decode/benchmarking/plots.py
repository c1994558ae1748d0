"""The benchmarks' plots: a path matplotlib can write, checked before any work, and a figure saved there atomically."""
from pathlib import Path

from decode.atomic import FILE, atomic_output, check_output
from decode.errors import InputError


def check_plot_path(path: Path, overwrite: bool, reads: dict) -> None:
    """A plot path matplotlib can write, none of the inputs (`reads`), checked before any decoding."""
    from matplotlib.figure import Figure

    check_output(path, FILE, overwrite, "--plot", reads)
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise InputError(f"--plot {path}: matplotlib cannot write {path.suffix or 'a file without extension'}; "
                         f"end the name in one of {', '.join('.' + f for f in sorted(formats))}")


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, overwrite: bool) -> None:
    """The figure written to `path` in the format its suffix names, then closed."""
    with atomic_output(path, FILE, overwrite) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".").lower(), dpi=120)
    pyplot().close(fig)
