"""The `format` values a schema may use: string formats as patterns (compiled like any
other pattern), numeric formats as integer bounds."""
from __future__ import annotations

from .errors import SchemaError, pointer
from .keywords import FORMATS

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR = r"(?:[01][0-9]|2[0-3])"
_TIME = rf"{_HOUR}:[0-5][0-9]:[0-5][0-9](?:\.[0-9]{{1,9}})?(?:Z|[+\-]{_HOUR}:[0-5][0-9])"
_HEX = "[0-9a-fA-F]"
_PCT = f"%{_HEX}{{2}}"
_UNRESERVED = r"A-Za-z0-9\-._~"
_SUB_DELIMS = r"!$&'()*+,;="
_PCHAR = rf"(?:[{_UNRESERVED}{_SUB_DELIMS}:@]|{_PCT})"
_AUTHORITY = (rf"(?:(?:[{_UNRESERVED}{_SUB_DELIMS}:]|{_PCT})*@)?"
              rf"(?:[{_UNRESERVED}{_SUB_DELIMS}]|{_PCT})*(?::[0-9]*)?")
# Paths as one loop each ((/seg)* == (/(seg|/)*)?): a maxLength then caps them evenly.
_HIER = rf"(?://{_AUTHORITY}(?:/(?:{_PCHAR}|/)*)?|/(?:{_PCHAR}(?:{_PCHAR}|/)*)?|{_PCHAR}(?:{_PCHAR}|/)*|)"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]"
# Host labels joined by dots; letters/digits, with runs of at most 2 inner hyphens (xn--).
_HOST_RUN = r"[A-Za-z0-9](?:(?:\.|-{1,2})?[A-Za-z0-9])*"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"

STRING_FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "email": rf"^{_ATEXT}(?:\.?{_ATEXT})*@{_HOST_RUN}\.{_HOST_RUN}$",
    "uri": rf"^[A-Za-z][A-Za-z0-9+.\-]*:{_HIER}(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?$",
    "ipv4": rf"^{_OCTET}(?:\.{_OCTET}){{3}}$",
}
NUMERIC_FORMATS = {"int32": (-2 ** 31, 2 ** 31 - 1), "int64": (-2 ** 63, 2 ** 63 - 1),
                   "float": None, "double": None}


def schema_formats(schema: dict, path: tuple) -> list[str]:
    """The formats a schema asks for (its own and those merged from allOf); SchemaError
    on one not known here."""
    merged = schema.get(FORMATS, [])
    if not isinstance(merged, list):
        raise SchemaError(f"'{FORMATS}' must be a list", pointer(path + (FORMATS,)))
    formats = ([schema["format"]] if "format" in schema else []) + merged
    for f in formats:
        if not isinstance(f, str) or (f not in STRING_FORMATS and f not in NUMERIC_FORMATS):
            raise SchemaError(f"unsupported format {f!r}", pointer(path + ("format",)))
    return formats
