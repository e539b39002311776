"""The ServerApp: fedloom's round loop (sampling, aggregation, evaluation) on the Flower grid."""

from fedloom.flower import server_app
from fedloom_app import CONFIG

app = server_app(CONFIG, write=False)
