"""Dead letters: messages that could not be processed, kept per group with the reason.

:class:`DeadLetters` lists, shows, redrives (to the group that failed them only) and purges them;
:mod:`framework.dead_letters.reasons` builds the reason fields the runtime stores with each one.
"""

from framework.dead_letters.admin import DeadLetter, DeadLetters, body_view

__all__ = ["DeadLetter", "DeadLetters", "body_view"]
