"""The service: config, watcher, scheduler, worker loop, CLI and service install."""
