"""Alert notification channels (docs/alerts.md#notification-channels).

- channels.py   every change to a channel: create, update, delete, rotate the secret,
                queue a test; the channel's credentials in the tenant's schema
- dispatch.py   the outbox: alerts not yet dispatched become one delivery per matching
                channel (the periodic alerts.dispatch_notifications job)
- delivery.py   one attempt of one delivery: webhook or e-mail, the outcome recorded,
                back-off (the alerts.deliver_notification job)
- signing.py    the webhook signature
- selectors.py  reads shared by the API and the admin

Nothing here hooks into raising an alert: the heartbeat raises GPU_LOST with its own
statement, so the dispatcher picks new and ended alerts up from the alerts table.
"""
