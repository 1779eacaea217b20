-- An order-entry schema after Swingbench's SOE (the workload of F5's Data Guard test), cut to
-- what its "new order process" touches. psql variable :customers sets the customer count.
CREATE TABLE customers (
  customer_id bigint PRIMARY KEY, cust_first_name text NOT NULL, cust_last_name text NOT NULL,
  nls_territory text, credit_limit numeric(9,2), cust_email text, account_mgr_id int,
  customer_since date, customer_class text, dob date, mailshot boolean,
  preferred_address bigint, preferred_card bigint);
CREATE TABLE inventories (
  product_id int, warehouse_id int, quantity_on_hand int NOT NULL,
  PRIMARY KEY (product_id, warehouse_id));
CREATE TABLE orders (
  order_id bigserial PRIMARY KEY, order_date timestamptz NOT NULL, order_mode text,
  customer_id bigint NOT NULL, order_status int, order_total numeric(8,2), sales_rep_id int,
  promotion_id int, warehouse_id int, delivery_type text, cost_of_delivery int,
  wait_till_date timestamptz, delivery_address_id bigint, customer_class text, card_id bigint,
  invoice_address_id bigint);
CREATE INDEX ord_customer_ix ON orders (customer_id);
CREATE INDEX ord_sales_rep_ix ON orders (sales_rep_id);
CREATE INDEX ord_order_date_ix ON orders (order_date);
CREATE INDEX ord_warehouse_ix ON orders (warehouse_id, order_status);
CREATE TABLE order_items (
  order_id bigint NOT NULL, line_item_id int NOT NULL, product_id int NOT NULL,
  unit_price numeric(8,2), quantity int, dispatch_date timestamptz, gift_wrap text,
  condition text, supplier_id int, estimated_delivery timestamptz,
  PRIMARY KEY (order_id, line_item_id));
CREATE INDEX item_product_ix ON order_items (product_id);
INSERT INTO customers
  SELECT i, initcap(substr(md5(i::text), 1, 3 + i % 7)), initcap(substr(md5((i * 7)::text), 1, 4 + i % 9)),
    (ARRAY['America', 'Europe', 'Asia', 'Africa'])[1 + i % 4], (random() * 5000)::numeric(9,2),
    substr(md5(i::text), 1, 10) || '@example.com', 1 + i % 100,
    date '2000-01-01' + (random() * 8000)::int,
    (ARRAY['Occasional', 'Regular', 'Business', 'Prime'])[1 + i % 4],
    date '1950-01-01' + (random() * 18000)::int, random() < 0.5, i * 2, i * 3
  FROM generate_series(1, :customers) i;
INSERT INTO inventories
  SELECT p, w, (random() * 1000)::int FROM generate_series(1, 1000) p, generate_series(1, 20) w;
VACUUM ANALYZE;
