"""The error raised for data on disk (or its description) that breaks the domain's rules.

It lives here, not in ``data/``, because the domain layer itself raises it (an unknown
class name, a group without OME-NGFF metadata) and must not import the floors above it.
"""

from __future__ import annotations

from torchtitan.errors import UserError


class DatasetError(UserError, ValueError):
    """A problem with the data on disk or its description; the message says what to fix."""
