"""`from jaxmoral import api`: the notebook API (defined in `jaxmoral.models.api`)."""

from jaxmoral.models.api import GenerateOutput  # noqa: F401
from jaxmoral.models.api import Model  # noqa: F401
from jaxmoral.models.api import bucket  # noqa: F401
from jaxmoral.models.api import from_pretrained  # noqa: F401
