"""An audio request's ``multipart/form-data`` body, read with bounds on every part."""

from __future__ import annotations

from triton_pipelines.openai_api import protocol as proto


async def read_multipart(request) -> tuple[dict[str, str], str | None, bytes | None]:
    """The multipart body, bounded: at most ``MAX_MULTIPART_PARTS`` parts, the ``file`` part at most
    the audio limit, other fields ``MAX_FIELD_BYTES``, the file name ``MAX_FILENAME_CHARS``."""
    from aiohttp import http_exceptions

    from triton_pipelines.limits import MAX_AUDIO_BYTES

    if not (request.content_type or "").startswith("multipart/form-data"):
        raise proto.invalid(f"the body must be multipart/form-data with a 'file' part, not "
                            f"{(request.content_type or 'none')[:64]!r}")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as error:
        raise proto.invalid(f"the multipart body cannot be read: {str(error)[:200]}") from None
    fields: dict[str, str] = {}
    filename, data = None, None
    parts = 0
    try:
        while True:
            part = await reader.next()
            if part is None:
                break
            parts += 1
            if parts > proto.MAX_MULTIPART_PARTS:
                raise proto.invalid(f"the multipart body has more than {proto.MAX_MULTIPART_PARTS} parts")
            if not hasattr(part, "read_chunk"):  # a nested multipart
                raise proto.invalid("nested multipart bodies are not accepted")
            name = part.name or ""
            if len(name) > 64:
                raise proto.invalid("a multipart part's name is longer than 64 characters")
            if name == "file":
                if data is not None:
                    raise proto.invalid("'file' is given twice", "file")
                raw_name = part.filename or ""
                if len(raw_name) > proto.MAX_FILENAME_CHARS:
                    raise proto.invalid(f"the file name is {len(raw_name)} characters; at most "
                                        f"{proto.MAX_FILENAME_CHARS}", "file")
                filename = raw_name
                data = await bounded_read(part, MAX_AUDIO_BYTES, lambda: proto.too_large(
                    f"'file' is larger than the audio limit of {MAX_AUDIO_BYTES} bytes ({MAX_AUDIO_BYTES >> 20} MiB)",
                    "file"))
            else:
                value = await bounded_read(part, proto.MAX_FIELD_BYTES, lambda: proto.invalid(
                    f"the multipart field '{name[:64]}' is longer than {proto.MAX_FIELD_BYTES} bytes", name[:64]))
                if name in fields:
                    raise proto.invalid(f"the field '{name}' is given twice", name)
                try:
                    fields[name] = value.decode("utf-8")
                except UnicodeDecodeError:
                    raise proto.invalid(f"the field '{name[:64]}' is not UTF-8 text", name[:64]) from None
    except proto.OpenAIError:
        raise
    except http_exceptions.LineTooLong:
        raise proto.invalid("a multipart part's headers are too long (a file name of at most "
                            f"{proto.MAX_FILENAME_CHARS} characters)", "file") from None
    except (ValueError, AssertionError, RuntimeError, http_exceptions.HttpProcessingError) as error:
        raise proto.invalid(f"the multipart body cannot be read: {str(error)[:200]}") from None
    return fields, filename, data


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
