"""Service definitions (a LaunchAgent plist and a systemd --user unit), shipped as package data."""
