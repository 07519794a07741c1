"""Operators' actions on jobs that are under way: `cancel` (a waiting, scheduled, retrying or running job ends
`cancelled`). The CLI (`pipeline cancel`), the API (`POST /jobs/{id}/cancel`) and the page call them."""
