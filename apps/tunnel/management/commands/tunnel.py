from django.core.management.base import BaseCommand

from apps.tunnel import server


class Command(BaseCommand):
    help = "Run the tunnel process: the agents' outbound tunnels and the relay to them (docs/tunnel.md)."

    def handle(self, *args, **options):
        server.run()
