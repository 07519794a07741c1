"""Text field types shared by payload models and settings.

`HeaderText` is text that ends up in one line of a protocol header (an email's Subject, a display name,
From): it refuses every line or paragraph separator Python, mail clients or a terminal might act on
(`\\r`, `\\n`, `\\v`, `\\f`, U+001C-U+001E, U+0085, U+2028, U+2029) and every other control character
(Unicode category Cc, tab included), so a value can neither start a new header nor be cut in two. The
check runs at validation, i.e. at `enqueue` and in the API (422), not when the worker builds the message.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, EmailStr, Field
from pydantic_core import PydanticCustomError

#: The same rule as a JSON Schema pattern (documentation for clients; `single_line` is what validates).
HEADER_TEXT_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"
_REFUSED_CATEGORIES = {"Cc", "Zl", "Zp"}  # control characters, line separator, paragraph separator


def single_line(value: str) -> str:
    """`value` unchanged if it has no line break, separator or control character; else a validation error."""
    for position, char in enumerate(value):
        if unicodedata.category(char) in _REFUSED_CATEGORIES:
            raise PydanticCustomError(
                "header_text",
                "must be a single line of text: no line breaks, line or paragraph separators or control "
                "characters (found U+{code} at position {position})",
                {"code": f"{ord(char):04X}", "position": position},
            )
    return value


def _single_line_if_text(value: Any) -> Any:
    return single_line(value) if isinstance(value, str) else value


#: One line of header text (a subject, a display name): see the module's docstring.
HeaderText = Annotated[str, AfterValidator(single_line), Field(json_schema_extra={"pattern": HEADER_TEXT_PATTERN})]

#: An email address (`Name <addr>` is accepted; only the address is kept) whose text is one header line.
HeaderEmail = Annotated[EmailStr, BeforeValidator(_single_line_if_text)]
