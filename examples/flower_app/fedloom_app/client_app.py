"""The ClientApp: the node with node config ``partition-id=K`` trains fedloom client K."""

from fedloom.flower import client_app
from fedloom_app import CONFIG

app = client_app(CONFIG)
