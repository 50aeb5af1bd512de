"""The building blocks of the HTTP request schema: strict models, valid-Unicode text, counts.

Shared by the OpenAI request models (`protocol`) and the structured-output ones (`constraints`),
so every string a client sends is checked the same way and the OpenAPI schema shows each bound.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

MAX_INT64 = 2**63 - 1


class StrictModel(BaseModel):
    """A request body part: JSON types as declared (no `"yes"` as a bool, no `1.0` as a token
    id), finite numbers only."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


def _valid_unicode(text: str) -> str:
    """Refuse unpaired surrogates (`"\\ud800"` is valid JSON but not encodable text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode",
            "string has an unpaired surrogate at position {position}; send valid Unicode text",
            {"position": exc.start},
        ) from None
    return text


def text_type(**constraints: Any) -> Any:
    """A string type: valid Unicode, with pydantic `Field` constraints checked first."""
    return Annotated[str, Field(**constraints), AfterValidator(_valid_unicode)]


Text = text_type()


def _whole_number(value: Any) -> Any:
    """`4.0` → 4: JSON Schema counts a whole float as an integer (and vLLM accepts it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def count_type(**constraints: Any) -> Any:
    """An integer type for counts and seeds: whole floats pass, token ids never use it (a token
    id is an integer, `1.0` is no token); constraints sit inside, where the schema shows them."""
    return Annotated[int, Field(**constraints), BeforeValidator(_whole_number)]


TokenId = Annotated[int, Field(ge=0, le=MAX_INT64)]


class TextPart(StrictModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class ImageUrl(StrictModel):
    """`image_url` of an image part: a `data:image/<type>;base64,...` URL (http(s) URLs are
    refused: the server reads no network); `detail` is accepted and ignored."""

    url: Text
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(StrictModel):
    """An image part of a message's content (vision-language models)."""

    type: Literal["image_url"]
    image_url: ImageUrl


def token_id_key_type(vocab_size: int = MAX_INT64 + 1) -> Any:
    """A JSON object key naming a token id (OpenAI's `logit_bias`): the decimal digits of an
    integer in [0, vocab_size); the schema shows it as a pattern, the check names the bound."""

    def check(key: str) -> str:
        digits = key.isascii() and key.isdigit() and len(key) <= 20
        if not (digits and int(key) < vocab_size and str(int(key)) == key):
            # The message names the key through the error's input (`error_param`): pydantic
            # fills in `{name}`, not `{name!r}`.
            raise PydanticCustomError(
                "token_id_key",
                "keys must be token ids, integers in [0, {vocab_size}) as decimal strings",
                {"vocab_size": vocab_size},
            )
        return key

    pattern = below_pattern(vocab_size)
    return Annotated[str, Field(json_schema_extra={"pattern": pattern}), AfterValidator(check)]


def below_pattern(bound: int) -> str:
    """A regular expression matching exactly the decimal integers in [0, bound) (bound >= 1),
    without leading zeros."""
    top = str(bound - 1)
    digits = len(top)
    shorter = ["0", f"[1-9][0-9]{{0,{digits - 2}}}"] if digits > 1 else []
    same_length = []
    for i, d in enumerate(top):  # a smaller digit at i, any digits after
        low = 1 if i == 0 and digits > 1 else 0
        if int(d) > low:
            same_length.append(f"{top[:i]}[{low}-{int(d) - 1}][0-9]{{{digits - i - 1}}}")
    return "^(" + "|".join([*shorter, *same_length, top]) + ")$"
