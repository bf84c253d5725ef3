"""Job labels: key/value pairs in the Kubernetes syntax, so a team can route and filter by them.

A key is an optional DNS-subdomain prefix and "/", then a name of 1-63 characters of letters, digits, "-", "_" and
".", starting and ending with a letter or digit (`team`, `example.com/cost-center`). A value is the same alphabet,
0-63 characters. A job has at most MAX_LABELS labels. Events carry labels as a plain mapping (readers tolerate);
the orchestrator checks them when a job is submitted, the notifier the keys of its label selectors.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

MAX_LABELS = 64
MAX_NAME = 63
MAX_VALUE = 63
MAX_PREFIX = 253
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_PREFIX = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_SPELLING = "letters, digits, '-', '_' or '.', starting and ending with a letter or digit"


def check_key(key: str) -> str:
    """The key if it is a valid label key; ValueError naming what is wrong otherwise."""
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > MAX_PREFIX or not _PREFIX.fullmatch(prefix)):
        raise ValueError(
            f"label key {key!r}: the prefix before '/' must be a DNS subdomain "
            f"(lowercase letters, digits, '-' and '.', at most {MAX_PREFIX} characters)"
        )
    if len(name) > MAX_NAME or not _NAME.fullmatch(name):
        raise ValueError(f"label key {key!r}: the name must be 1-{MAX_NAME} characters of {_SPELLING}")
    return key


def check_value(value: str) -> str:
    """The value if it is a valid label value (empty is); ValueError otherwise."""
    if value and (len(value) > MAX_VALUE or not _NAME.fullmatch(value)):
        raise ValueError(f"label value {value!r}: at most {MAX_VALUE} characters of {_SPELLING}, or empty")
    return value


LabelKey = Annotated[str, AfterValidator(check_key)]
LabelValue = Annotated[str, AfterValidator(check_value)]
# Give a field of this type max_length=MAX_LABELS where it is declared.
Labels = dict[LabelKey, LabelValue]


def parse_selector(text: str) -> tuple[str, str]:
    """`key=value` as (key, value), both checked; ValueError naming what is wrong."""
    key, equals, value = text.partition("=")
    if not equals:
        raise ValueError(f"label selector {text!r}: expected key=value")
    return check_key(key), check_value(value)


def check_selector(text: str) -> str:
    """The text if it is a valid `key=value` selector (for a query parameter's validator); ValueError otherwise."""
    parse_selector(text)
    return text
