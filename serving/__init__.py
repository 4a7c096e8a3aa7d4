"""An OpenAI-compatible HTTP server on the built-in engine (`inferlab serve`, docs/serving.md).

from serving import ServerConfig, create_app
app = create_app(loaded_builtin_backend, ServerConfig(max_queue_len=64))
"""

from serving.app import create_app
from serving.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
