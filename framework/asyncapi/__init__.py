"""The services' machine-readable contract: an AsyncAPI 3.0.0 document and its HTML view.

:func:`build_document` describes services (channels for their queues and topics, a ``receive``
operation per handler, message schemas from the payload types); :func:`render_html` turns the
document into one self-contained page. ``framework asyncapi MODULE:SERVICE`` is the command.
"""

from __future__ import annotations

from framework.asyncapi.document import ASYNCAPI_VERSION, AsyncAPIError, build_document
from framework.asyncapi.html import render_html
from framework.asyncapi.schema import SchemaBuilder, UnsupportedType

__all__ = ["ASYNCAPI_VERSION", "AsyncAPIError", "SchemaBuilder", "UnsupportedType", "build_document", "render_html"]
