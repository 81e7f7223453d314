"""Every Python block of the README and the docs site runs; the troubleshooting page names
every exception."""
