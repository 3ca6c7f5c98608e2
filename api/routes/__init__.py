"""The REST API's routers, one per concern: models, fits, plots, the page, operations."""
