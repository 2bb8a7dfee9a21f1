from npumoe.daemon.cli import main

main()
