"""What every command-line tool shares in how it presents itself."""
import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default shown once: appended where its help does not already say it, and left out where there
    is none to show (None, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action) or ""
