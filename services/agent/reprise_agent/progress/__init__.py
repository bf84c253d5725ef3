"""Training progress from the SDK: the wire messages ranks send, the book of each rank's progress, the socket."""
