\set account random(0, 999)
BEGIN;
INSERT INTO bench_events (account, amount) VALUES (:account, 1);
UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account;
INSERT INTO bench_raw_outbox (key, msg_id, payload) VALUES ('account-' || :account, md5(random()::text), convert_to(repeat('.', 200), 'UTF8'));
COMMIT;
