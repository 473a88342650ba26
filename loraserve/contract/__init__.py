"""What both services and the clients share: the adapter payload layout, the chunk codec of
FetchAdapter, and the Usage of a finished request."""
