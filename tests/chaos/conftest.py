"""What the chaos tests share: a tally of one `generate` call's results under a fault."""

from __future__ import annotations

import pytest
from tally import Tally


@pytest.fixture
def tally() -> type[Tally]:
    return Tally
