"""An audio request's ``multipart/form-data`` body, read with bounds on every part.

A part's ``Content-Disposition`` is read here (``disposition``), strictly, rather than by aiohttp's
``part.name``: aiohttp reads a header it cannot parse (a duplicated parameter, a quote a line break
cut short) as no name at all and warns, so such a part became the field ``''``; here each is a 400
saying what is wrong with it."""

from __future__ import annotations

import re
from urllib.parse import unquote

from triton_pipelines.openai_api import protocol as proto

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# One parameter after a ';': key = token or "quoted string", up to the next ';' or the end.
_PARAMETER = re.compile(r'[ \t]*(?P<key>[^ \t=;]+)[ \t]*=[ \t]*(?:"(?P<quoted>(?:[^"\\]|\\.)*)"|(?P<token>[^ \t;"]+))'
                        r'[ \t]*(?:;|$)')
_RFC5987 = re.compile(r"(?P<charset>[A-Za-z0-9!#$%&+^_`{}~-]+)'[A-Za-z0-9-]*'(?P<value>.*)")
DISPOSITION_FORM = "'Content-Disposition: form-data; name=\"<field>\"'"


def _bad(problem: str) -> proto.OpenAIError:
    return proto.invalid(f"a multipart part's Content-Disposition {problem}")


def parse_disposition(header: str) -> tuple[str, dict[str, str]]:
    """``form-data; name="model"; filename="a.wav"`` → ("form-data", {"name": ..., "filename": ...})
    (keys lower case, quoted values unescaped), or 400 saying what is wrong."""
    kind, _, rest = header.partition(";")
    kind = kind.strip().lower()
    if not _TOKEN.fullmatch(kind):
        raise _bad(f"does not start with its type (form-data): {header[:64]!r}")
    params: dict[str, str] = {}
    position = 0
    while rest[position:].strip(" \t;"):
        if rest[position] == ";" or not rest[position:position + 1].strip():
            position += 1  # empty parameters (';;', a trailing ';') and spaces
            continue
        match = _PARAMETER.match(rest, position)
        if match is None:
            raise _bad(_parameter_problem(rest[position:]))
        key = match["key"].lower()
        if not _TOKEN.fullmatch(key):
            raise _bad(f"has a parameter whose name {key[:32]!r} is not a token")
        if key in params:
            raise _bad(f"has the parameter '{key[:32]}' twice")
        params[key] = re.sub(r"\\(.)", r"\1", match["quoted"]) if match["quoted"] is not None else match["token"]
        position = match.end()
    return kind, params


def _parameter_problem(text: str) -> str:
    key, equals, value = text.partition("=")
    key = key.strip()[:32]
    if not equals or ";" in key:
        return f"has a parameter without a value: {key.split(';')[0]!r}"
    value = value.lstrip(" \t")
    if not value or value.startswith(";"):
        return f"has a parameter without a value: {key!r}"
    if value.startswith('"') and not re.match(r'"(?:[^"\\]|\\.)*"', value):
        return (f"opens a quote in '{key}' that it does not close: a line break (CR or LF) in a value, e.g. "
                f"in a file name, ends the header line; send file names without line breaks")
    return f"has a value of '{key}' that is neither a token nor one quoted string"


def disposition(part) -> tuple[str, str | None]:
    """A part's field name and file name (``filename*=charset''<percent-encoded>`` first, RFC 5987),
    or 400: no Content-Disposition, two of them, not form-data, no name, a malformed parameter."""
    headers = part.headers.getall("Content-Disposition", [])
    if not headers:
        raise proto.invalid(f"a multipart part has no Content-Disposition header: each part needs {DISPOSITION_FORM}")
    if len(headers) > 1:
        raise proto.invalid("a multipart part has two Content-Disposition headers")
    kind, params = parse_disposition(headers[0])
    if kind != "form-data":
        raise _bad(f"must be form-data, not {kind[:32]!r}")
    name = params.get("name")
    if not name:
        raise _bad(f"has no name: each part needs {DISPOSITION_FORM}")
    filename = params.get("filename")
    if "filename*" in params:
        match = _RFC5987.fullmatch(params["filename*"])
        try:
            filename = unquote(match["value"], match["charset"], "strict") if match else None
        except (LookupError, UnicodeDecodeError):
            filename = None
        if filename is None:
            raise _bad("has a filename* that is not charset'language'<percent-encoded text> (RFC 5987)")
    return name, filename


async def read_multipart(request) -> tuple[dict[str, str], str | None, bytes | None]:
    """The multipart body, bounded: at most ``MAX_MULTIPART_PARTS`` parts, the ``file`` part at most
    the audio limit, other fields ``MAX_FIELD_BYTES``, the file name ``MAX_FILENAME_CHARS``."""
    from aiohttp import http_exceptions

    if not (request.content_type or "").startswith("multipart/form-data"):
        raise proto.invalid(f"the body must be multipart/form-data with a 'file' part, not "
                            f"{(request.content_type or 'none')[:64]!r}")
    from aiohttp import MultipartReader
    from aiohttp.helpers import parse_mimetype

    try:
        boundary = parse_mimetype(request.headers["Content-Type"]).parameters.get("boundary", "")
        reader = MultipartReader(request.headers, BoundedPreamble(request.content, boundary))
    except (ValueError, AssertionError) as error:
        raise proto.invalid(f"the multipart body cannot be read: {str(error)[:200]}") from None
    fields: dict[str, str] = {}
    found: dict[str, str | bytes | None] = {"filename": None, "data": None}
    try:
        for parts in range(1, proto.MAX_MULTIPART_PARTS + 2):
            part = await reader.next()
            if part is None:
                break
            if parts > proto.MAX_MULTIPART_PARTS:
                raise proto.invalid(f"the multipart body has more than {proto.MAX_MULTIPART_PARTS} parts")
            await read_part(part, fields, found)
    except proto.OpenAIError:
        raise
    except http_exceptions.LineTooLong:
        raise proto.invalid("a multipart part's headers are too long (a file name of at most "
                            f"{proto.MAX_FILENAME_CHARS} characters)", "file") from None
    except http_exceptions.InvalidHeader as error:
        raise proto.invalid(f"a multipart part's header line is not 'Name: value' ({str(error.hdr)[:64]!r}): a "
                            "line break (CR or LF) or a control character inside a header value, e.g. in a file "
                            "name, breaks the header") from None
    except http_exceptions.HttpProcessingError as error:
        raise proto.invalid(f"the multipart body cannot be read: {str(error.message)[:200]}") from None
    except (ValueError, AssertionError, RuntimeError) as error:
        raise proto.invalid(f"the multipart body cannot be read: {str(error)[:200]}") from None
    return fields, found["filename"], found["data"]


class BoundedPreamble:
    """A request's body stream for aiohttp's MultipartReader, with at most
    ``proto.MAX_MULTIPART_PREAMBLE_BYTES`` before the first boundary line: the reader reads that
    preamble a line at a time (an await per line), so 60 MiB of line breaks held the event loop
    100 s. Past the first boundary it is the stream itself (part bodies are read in chunks, part
    headers bounded by the reader)."""

    def __init__(self, content, boundary: str):
        self._content = content
        self._delimiter = b"--" + boundary.strip('"').encode("latin-1", "replace")
        self._left: int | None = proto.MAX_MULTIPART_PREAMBLE_BYTES  # None: past the first boundary

    async def readline(self, *args, **kwargs) -> bytes:
        line = await self._content.readline(*args, **kwargs)
        if self._left is not None:
            if line.rstrip() in (self._delimiter, self._delimiter + b"--"):
                self._left = None
            else:
                self._left -= len(line)
                if self._left < 0:
                    raise proto.invalid(f"the multipart body does not start with its boundary: more than "
                                        f"{proto.MAX_MULTIPART_PREAMBLE_BYTES} bytes come before the first one")
        return line

    def __getattr__(self, name):  # read, at_eof, unread_data: the stream's own
        return getattr(self._content, name)


async def read_part(part, fields: dict[str, str], found: dict) -> None:
    """One part: the ``file`` into ``found`` (its name and bytes), any other into ``fields`` (text)."""
    from triton_pipelines.limits import MAX_AUDIO_BYTES

    if not hasattr(part, "read_chunk"):  # a nested multipart
        raise proto.invalid("nested multipart bodies are not accepted")
    name, raw_name = disposition(part)
    if len(name) > 64:
        raise proto.invalid("a multipart part's name is longer than 64 characters")
    if name == "file":
        if found["data"] is not None:
            raise proto.invalid("'file' is given twice", "file")
        raw_name = raw_name or ""
        if len(raw_name) > proto.MAX_FILENAME_CHARS:
            raise proto.invalid(f"the file name is {len(raw_name)} characters; at most "
                                f"{proto.MAX_FILENAME_CHARS}", "file")
        found["filename"] = raw_name
        found["data"] = await bounded_read(part, MAX_AUDIO_BYTES, lambda: proto.too_large(
            f"'file' is larger than the audio limit of {MAX_AUDIO_BYTES} bytes ({MAX_AUDIO_BYTES >> 20} MiB)",
            "file"))
        return
    value = await bounded_read(part, proto.MAX_FIELD_BYTES, lambda: proto.invalid(
        f"the multipart field '{name}' is longer than {proto.MAX_FIELD_BYTES} bytes", name))
    if name in fields and not name.endswith("[]"):
        raise proto.invalid(f"the field '{name}' is given twice", name)
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise proto.invalid(f"the field '{name}' is not UTF-8 text", name) from None
    # an array field (name[]) comes as one part per value: kept one value a line
    fields[name] = f"{fields[name]}\n{text}" if name in fields else text


async def bounded_read(part, limit: int, error) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = await part.read_chunk(1 << 16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise error()
        chunks.append(chunk)
