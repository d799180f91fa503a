"""The control plane's REST API; build it with `supervisor.api.app.create_app(settings)`."""
