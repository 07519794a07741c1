"""Operators' actions on jobs and flows that are under way: `cancel` (a waiting, scheduled, retrying or running job
ends `cancelled`) and `flows` (a flow's status, the recent flows, a flow's cancel). The CLI (`pipeline cancel`,
`pipeline flow ...`), the API (`POST /jobs/{id}/cancel`, `/flows`) and the page call them."""
