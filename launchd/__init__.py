"""Service definitions (a LaunchAgent plist and a systemd --user unit), shipped as package data; the folder is
named for launchd, as the project's design card names it, and holds the Linux unit too."""
