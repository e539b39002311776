"""Serving (docs/serving.md): the confidence router between a client's personal model and the
global model, its accuracy next to each model's, and ``fedloom export``'s deployable models."""

from fedloom.serving.export import export_run, load_exported
from fedloom.serving.router import route
from fedloom.serving.routing import add_routing, routing_summary

__all__ = ["add_routing", "export_run", "load_exported", "route", "routing_summary"]
