"""The bottom layer: parameter trees, the model as functions, random streams and the types of
the client protocol. Everything else in fedloom builds on it; it imports nothing above it."""
